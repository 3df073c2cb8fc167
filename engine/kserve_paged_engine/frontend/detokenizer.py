"""Turns a request's output tokens into text as they arrive, and applies its stop strings.

Why incremental: decoding the whole output every step is O(n^2) over a request. Each update
decodes only a short window of ids twice: from ``_prefix`` (a few tokens already turned into
text, kept as context so that tokenizers which change a token's text at the start of a string,
e.g. SentencePiece's leading space, render it as they would mid-text) to ``_read`` (the end of
the text already emitted), and from ``_prefix`` to the end. The difference is the new text. A
character made of several byte-level tokens decodes to U+FFFD until its last byte arrives, so
while the window's text ends in U+FFFD nothing is emitted and the offsets stay put.

Stop strings are searched only in the new text plus the tail of the old text that a stop
string could start in. Streaming clients get text through ``get_delta``, which holds back the
last ``max(len(stop)) - 1`` characters while they could still become the start of a stop
string, so nothing they see is ever truncated away later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kserve_paged_engine.sampling_params import SamplingParams

# Prompt tokens decoded as context in front of the first output token.
PROMPT_CONTEXT_TOKENS = 5
# Ids before the decode window are dropped once this many pile up (keeps memory O(window)).
_TRIM_AT = 256
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    """Per-request text state: ``output_text``, ``stopped`` and ``stop_reason``."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: tuple[str, ...] = tuple(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Text after a match is cut but text before it never is when the stop string is kept,
        # so holding back is only needed when the stop string is removed.
        self._hold = 0 if self._include_stop else max(self._max_stop - 1, 0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        # The text as chunks (joined lazily); _length chars in all, _sent of them streamed.
        self._parts: list[str] = []
        self._length = 0
        self._sent = 0
        self.stopped = False
        self.stop_reason: str | None = None

    # -- text storage -------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text so far (after stop-string truncation)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _tail(self, n: int) -> str:
        """The last ``n`` characters, touching only the chunks that hold them."""
        if n <= 0:
            return ""
        got: list[str] = []
        size = 0
        for part in reversed(self._parts):
            got.append(part)
            size += len(part)
            if size >= n:
                break
        text = "".join(reversed(got))
        return text[len(text) - n:] if size > n else text

    def _drop_tail(self, n: int) -> None:
        """Remove the last ``n`` characters."""
        self._length -= n
        while n > 0:
            part = self._parts.pop()
            if len(part) > n:
                self._parts.append(part[:len(part) - n])
                break
            n -= len(part)

    def _append(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._length += len(text)

    # -- updates --------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites spaces around punctuation per window, which would make the
        # pieces disagree with one another.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False,
               check_stop: bool = True) -> None:
        """Add tokens, extend the text and check the stop strings; sets ``stopped`` on a match.

        ``stop_terminated``: the last token ended the request (EOS or a stop token id); its
        text is left out unless ``include_stop_str_in_output``, as vLLM does.
        ``check_stop``: False while the request is still under its ``min_tokens``.
        """
        if self.stopped:
            return
        ids = list(new_token_ids)
        if stop_terminated and ids and not self._include_stop:
            ids.pop()
        if not ids:
            return
        self._ids.extend(ids)
        window = self._ids[self._prefix:]
        before = self._decode(window[:self._read - self._prefix])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return  # nothing new, or the last character is still incomplete
        new_text = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        old_length = self._length
        self._append(new_text)
        if self._stops and check_stop:
            self._check_stop(old_length, new_text)

    def _check_stop(self, old_length: int, new_text: str) -> None:
        """Find the earliest stop string that ends in the new text and cut the text there.

        A stop string can start up to ``len(stop) - 1`` characters before the new text.
        Earliest start wins; at the same start, the shorter one (it completed first).
        """
        carried = min(self._max_stop - 1, old_length)
        text = self._tail(carried + len(new_text))
        best: tuple[int, int] | None = None
        for stop in self._stops:
            # Skip matches lying wholly in the old text: they would have been found before.
            pos = text.find(stop, max(0, carried - len(stop) + 1))
            if pos >= 0 and (best is None or (pos, len(stop)) < best):
                best = (pos, len(stop))
        if best is None:
            return
        pos, size = best
        self.stop_reason = text[pos:pos + size]
        self.stopped = True
        keep = pos + size if self._include_stop else pos
        self._drop_tail(len(text) - keep)
        self._sent = min(self._sent, self._length)

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned before. Until the request ends (``finished`` or a stop string
        matched) it holds back what could still turn into a stop string."""
        end = self._length
        if not (finished or self.stopped):
            end -= self._hold
        if end <= self._sent:
            return ""
        pending = self._tail(self._length - self._sent)
        delta = pending[:end - self._sent]
        self._sent = end
        return delta
