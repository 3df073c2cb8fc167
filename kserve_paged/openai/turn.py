"""One streamed assistant turn as protocol-neutral pieces: reasoning text, answer text, tool-call
pieces, and the end. Chat completions, Responses and Messages each render the same pieces in
their own event shapes, so the split into reasoning / answer / calls is written once.

Order: the reasoning parser (`reasoning.py`) takes the raw text first; only the answer that
follows the reasoning reaches the tool-call parser (`tools.StreamedCalls`), which holds back
what may still become a call. Harmony (`harmony.py`) splits all three at once: its calls
stream as they come (name first, then the arguments), with tool_choice "auto".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kserve_paged.openai.harmony import HARMONY_PARSER, HarmonyPiece, HarmonyStream
from kserve_paged.openai.reasoning import ReasoningStream
from kserve_paged.openai.tools import StreamedCalls, ToolCall, ToolPlan, with_calls


@dataclass(slots=True)
class CallPiece:
    """Part of tool call `index`: its id and name when it starts, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class TurnPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class TurnStream:
    """Feed each new piece of one choice's text; get what it adds, in order."""

    def __init__(self, plan: ToolPlan | None, reasoning_parser: str | None) -> None:
        harmony = reasoning_parser == HARMONY_PARSER
        self._harmony = HarmonyStream() if harmony else None
        self._harmony_calls = harmony and plan is not None and plan.choice == "auto"
        self._reasoning = (ReasoningStream(reasoning_parser)
                           if reasoning_parser and not harmony else None)
        self._calls = StreamedCalls(plan) if plan and not self._harmony_calls else None
        self.reasoning = ""  # all of it so far
        self.content = ""  # the answer so far, before tool-call parsing

    @property
    def calls(self) -> list[ToolCall]:
        if self._harmony_calls and self._harmony is not None:
            return self._harmony.calls
        return self._calls.calls if self._calls else []

    @property
    def reasoning_ended(self) -> bool:
        return self._reasoning is None or self._reasoning.reasoning_ended

    def _harmony_pieces(self, got: HarmonyPiece) -> tuple[str, str, list[TurnPiece]]:
        """(reasoning, answer, call pieces) of one Harmony delta; a call counts only with
        tool_choice "auto" (else its text is dropped, as a whole output's is)."""
        calls = []
        if self._harmony_calls:
            calls = [TurnPiece(calls=[CallPiece(i, call.id, call.name)])
                     for i, call in got.new_calls]
            calls += [TurnPiece(calls=[CallPiece(i, arguments=text)])
                      for i, text in got.arguments]
        return got.reasoning, got.content, calls

    def feed(self, delta: str, finished: bool) -> list[TurnPiece]:
        harmony_calls: list[TurnPiece] = []
        if self._harmony is not None:
            thought, said, harmony_calls = self._harmony_pieces(
                self._harmony.feed(delta, final=finished))
        elif self._reasoning is not None:
            thought, said = self._reasoning.feed(delta)
            if finished:
                more_thought, more_said = self._reasoning.finish()
                thought, said = thought + more_thought, said + more_said
        else:
            thought, said = "", delta
        pieces = [TurnPiece(reasoning=thought)] if thought else []
        self.reasoning += thought
        self.content += said
        if self._calls is None:
            if said:
                pieces.append(TurnPiece(content=said))
            return pieces + harmony_calls
        for d in self._calls.feed(self.content, finished):
            piece = TurnPiece(content=d.content or "")
            for call in d.tool_calls or []:  # ChoiceDeltaToolCall models
                fn = call.function
                piece.calls.append(CallPiece(
                    index=call.index, id=call.id, name=fn.name if fn else None,
                    arguments=(fn.arguments if fn else None) or ""))
            if piece:
                pieces.append(piece)
        return pieces

    def finish_reason(self, reason: str) -> str:
        """The turn's finish reason with tool calls counted (chat's `tool_calls`)."""
        return with_calls(reason, self.calls)
