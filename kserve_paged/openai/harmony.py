"""gpt-oss output in OpenAI's Harmony format, read back into reasoning, answer and tool calls.

A Harmony turn is a run of messages, each ``<|start|>{role}{header}<|message|>{body}`` closed by
``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the turn's last). The generation
prompt ends in ``<|start|>assistant``, so the output begins inside the first header. A header
names the message's channel (``<|channel|>analysis``, ``commentary`` or ``final``), may name a
recipient (``to=functions.get_weather``, in the role part or after the channel) and a content
type (``<|constrain|>json`` or a bare ``json``).

- ``analysis``: the model's chain of thought -> ``message.reasoning``.
- ``final``: the answer -> ``message.content``.
- a recipient ``functions.NAME`` (on ``commentary``): a call of the request's tool NAME whose
  body is the JSON arguments -> ``tool_calls``.
- ``commentary`` without a recipient (a preamble the model says before calling tools) is text
  for the user: it joins ``message.content``, as vLLM shows it.
- a recipient that is not ``functions.*`` (gpt-oss' built-in browser / python tools, which we
  do not run) is the model's own work: it joins the reasoning.

We read the *decoded text* with the special tokens kept (``skip_special_tokens=False``), not
token ids through the ``openai_harmony`` package: that package downloads its tiktoken
vocabulary from the network at first use, and the server must start offline. The text is
read incrementally (`HarmonyStream`): a tag split over two deltas is held back, never shown
half, and a call's name is known from its header before its arguments stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kserve_paged.openai.tools import ToolCall

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
BODY_ENDS = (END, CALL, RETURN, START)  # what closes a message body (<|start|>: defensively)
FINAL_HEADER = CHANNEL + "final" + MESSAGE  # what opens the answer: where a constraint starts
FUNCTIONS = "functions."
HARMONY_PARSER = "openai_gptoss"  # vLLM's --reasoning-parser name for it
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Header:
    """One message's header, read from the text between its start and ``<|message|>``."""

    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        role_part, _, after = text.partition(CHANNEL)
        words = after.replace(CONSTRAIN, " ").split()  # a model may write the tag alone
        channel = words[0] if words else ""
        found = _RECIPIENT.search(role_part) or _RECIPIENT.search(after)
        return cls(channel, found.group(1) if found else None)

    @property
    def function(self) -> str | None:
        """The called function's name, for a message to ``functions.NAME``."""
        if self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None

    @property
    def kind(self) -> str:
        """Where the body goes: "call", "reasoning" or "content"."""
        if self.function:
            return "call"
        if self.recipient or self.channel == "analysis":
            return "reasoning"
        return "content"


def _held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `tags`."""
    longest = max(len(tag) for tag in tags) - 1
    for n in range(min(longest, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `tags` in `text` as (index, tag); (-1, "") when none is there."""
    found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else (-1, "")


@dataclass(slots=True)
class HarmonyPiece:
    """What one fed delta completes: reasoning text, answer text, and call parts (a new call
    as its `ToolCall` with empty arguments, then (index, argument text) pieces)."""

    reasoning: str = ""
    content: str = ""
    new_calls: list[tuple[int, ToolCall]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)


@dataclass(slots=True)
class HarmonyStream:
    """Incremental reader of one output's Harmony text: `feed` each delta (``final=True`` with
    the last), get what it completes. `calls`, `reasoning`, `content` hold all of it so far."""

    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    _pending: str = ""
    _header: str = ""  # the open message's header text so far
    _body: Header | None = None  # the open message's header once its body began
    _structured: bool = False  # any Harmony tag was seen: plain text is then no answer

    def feed(self, delta: str, final: bool = False) -> HarmonyPiece:
        piece = HarmonyPiece()
        text = self._pending + delta
        self._pending = ""
        while text:
            if self._body is None:  # inside a header (or between messages)
                at, tag = _first(text, (MESSAGE, START))
                if at < 0:
                    keep = 0 if final else _held_back(text, (MESSAGE, START))
                    self._header += text[:len(text) - keep]
                    self._pending = text[len(text) - keep:]
                    break
                self._header += text[:at]
                text = text[at + len(tag):]
                self._structured = True
                if tag == START:  # a new message: what came before was no header
                    self._header = ""
                    continue
                self._body = Header.parse(self._header)
                self._header = ""
                if self._body.kind == "call":
                    call = ToolCall(self._body.function or "", "")
                    self.calls.append(call)
                    piece.new_calls.append((len(self.calls) - 1, call))
                continue
            at, tag = _first(text, BODY_ENDS)
            body = text if at < 0 else text[:at]
            if at < 0:
                keep = 0 if final else _held_back(text, BODY_ENDS)
                body, self._pending = text[:len(text) - keep], text[len(text) - keep:]
            self._add(piece, body)
            if at < 0:
                break
            text = text[at + len(tag):]
            self._body = None
        if final and not self._structured and self._header:  # no Harmony at all: plain text
            piece.content += self._header
            self.content += self._header
            self._header = ""
        return piece

    def _add(self, piece: HarmonyPiece, body: str) -> None:
        if not body or self._body is None:
            return
        kind = self._body.kind
        if kind == "call":
            index = len(self.calls) - 1
            self.calls[index].arguments += body
            piece.arguments.append((index, body))
        elif kind == "reasoning":
            piece.reasoning += body
            self.reasoning += body
        else:
            piece.content += body
            self.content += body


def parse_harmony(text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole output's (reasoning, answer, tool calls); None for an empty part."""
    stream = HarmonyStream()
    stream.feed(text, final=True)
    return stream.reasoning or None, stream.content or None, stream.calls

