"""Reasoning parsers: a thinking model's output split into its reasoning and its answer.

`--reasoning-parser` names one, as in vLLM. Both parsers here read the `<think> ... </think>`
convention and differ only in where the thinking starts:
- `qwen3`: the model writes `<think>` itself (Qwen3 with `enable_thinking`; without it the
  template closes an empty think block in the prompt and the output has no tags). Output that
  does not open with `<think>` is all answer.
- `deepseek_r1`: the chat template already opened the block, so the output starts inside it
  (a stray `<think>` at the front is dropped). Output without `</think>` is all reasoning: the
  model was cut off while thinking.

The answer and the reasoning go to `message.content` and `message.reasoning` (vLLM's field
name); streamed, `delta.reasoning` then `delta.content`. `ReasoningStream` holds back the end
of the text while it could still be the start of a tag, so a tag split over two deltas is
never shown half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kserve_paged.openai.harmony import HARMONY_PARSER

START, END = "<think>", "</think>"
# HARMONY_PARSER (openai_gptoss): gpt-oss' Harmony channels, read by harmony.py instead.
REASONING_PARSERS = ("qwen3", "deepseek_r1", HARMONY_PARSER)


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """Reasoning (None when the model did not think) and answer (None when it is empty)."""

    reasoning: str | None
    content: str | None


def _starts_inside(parser: str) -> bool:
    if parser == HARMONY_PARSER:
        raise ValueError(f"{parser} output is read by openai/harmony.py, not by <think> tags")
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; one of "
                         f"{', '.join(REASONING_PARSERS)}")
    return parser == "deepseek_r1"


def split_reasoning(text: str, parser: str) -> ReasoningSplit:
    """The whole output's split (the stream's rules, fed at once)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, final=True)
    return ReasoningSplit(reasoning if stream.thought else None, content or None)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningStream:
    """Incremental split of a streamed output: `feed` each new piece of text, get the new
    reasoning and answer text it completes; `finish` flushes what was held back."""

    parser: str
    _state: str = field(init=False)  # "start" (may still open), "reasoning", "content"
    _pending: str = field(init=False, default="")
    _leading_newlines: bool = field(init=False, default=False)
    thought: bool = field(init=False, default=False)  # the output had a reasoning part

    def __post_init__(self) -> None:
        self._state = "reasoning_or_start" if _starts_inside(self.parser) else "start"

    @property
    def reasoning_ended(self) -> bool:
        """True once the answer has begun (or the model never thought)."""
        return self._state == "content"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new answer) that `delta` completes."""
        text = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while text:
            if self._state in ("start", "reasoning_or_start"):
                stripped = text.lstrip()
                if not stripped and not final:
                    self._pending = text  # only blanks so far: the tag may follow
                    return "", ""
                if stripped.startswith(START):
                    text, self._state, self.thought = stripped[len(START):], "reasoning", True
                    continue
                if START.startswith(stripped) and not final:
                    self._pending = text
                    break
                inside = self._state == "reasoning_or_start"
                self._state, self.thought = ("reasoning", True) if inside else ("content", False)
                continue
            if self._state == "reasoning":
                before, ended, after = text.partition(END)
                if ended:
                    reasoning.append(before)
                    text, self._state, self._leading_newlines = after, "content", True
                    continue
                keep = 0 if final else _held_back(text, END)
                reasoning.append(text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                break
            if self._leading_newlines:  # the blank line a template puts after </think>
                text = text.lstrip("\n")
                if not text:
                    break
                self._leading_newlines = False
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        return self.feed("", final=True)
