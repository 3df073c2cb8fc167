"""Engine log-probabilities -> the shapes clients read: OpenAI's legacy completions object,
OpenAI's chat ``content`` list, vLLM's ``prompt_logprobs`` and our v2 JSON.

Why here and not in the routes: both front ends (and both streaming and whole responses) must
render the same numbers the same way; the engine's entries are ``{token_id: Logprob}`` per
position, holding the chosen token and the requested top tokens (rank 1 = most likely).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

from kserve_paged_engine.outputs import Logprob

# OpenAI's stand-in for a log-probability too small to represent (JSON has no -Infinity).
VERY_UNLIKELY = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

Entry = dict[int, Logprob] | None


def finite(value: float) -> float:
    return value if math.isfinite(value) else VERY_UNLIKELY


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (printable stand-ins for the 256 bytes), inverted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenText:
    """A tokenizer's view of single tokens: their text and their raw bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int, entry: Entry = None) -> str:
        logprob = entry.get(token_id) if entry else None
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int, text: str) -> list[int]:
        """The token's UTF-8 bytes. A token holding part of a character decodes to U+FFFD, so
        its real bytes come from the vocabulary entry (byte-level BPE or ``<0xNN>`` pieces),
        which lets a client join the bytes of consecutive tokens into the right text."""
        if "\ufffd" in text:
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            piece = convert(token_id) if convert is not None else None
            if isinstance(piece, str) and piece:
                byte = _BYTE_TOKEN.match(piece)
                if byte:
                    return [int(byte.group(1), 16)]
                alphabet = _byte_level_alphabet()
                if all(c in alphabet for c in piece):
                    return [alphabet[c] for c in piece]
        return list(text.encode("utf-8"))


def _tops(entry: dict[int, Logprob], k: int, keep: int | None = None
          ) -> list[tuple[int, Logprob]]:
    """The entry's top ``k`` tokens by rank (plus token ``keep``), most likely first."""
    items = [(t, lp) for t, lp in entry.items() if lp.rank <= k or t == keep]
    return sorted(items, key=lambda item: (-item[1].logprob, item[1].rank))


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], k: int,
                        text: TokenText, offset: int = 0) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy ``logprobs`` object for ``token_ids`` (their entries aligned; ``None`` for
    the first prompt token, which nothing predicts). ``top_logprobs`` holds the top ``k`` and the
    chosen token, so up to k + 1 keys, as OpenAI documents. ``text_offset`` counts characters
    from ``offset`` (the start of the choice's text) through the tokens' own texts."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries):
        piece = text.text(token, entry)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        chosen = entry.get(token) if entry else None
        if chosen is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(chosen.logprob))
        top: dict[str, float] = {}
        for tid, lp in _tops(entry, k, keep=token):  # type: ignore[arg-type]
            top.setdefault(text.text(tid, entry), finite(lp.logprob))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}, offset


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], k: int,
                  text: TokenText) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content``: per token its text, log-probability, bytes and the top
    ``k`` alternatives (exactly the top k: the chosen token appears only if it is among them)."""
    content = []
    for token, entry in zip(token_ids, entries):
        piece = text.text(token, entry)
        chosen = entry.get(token) if entry else None
        tops = []
        for tid, lp in _tops(entry or {}, k):
            alt = text.text(tid, entry)
            tops.append({"token": alt, "logprob": finite(lp.logprob),
                         "bytes": text.bytes(tid, alt)})
        content.append({"token": piece,
                        "logprob": finite(chosen.logprob) if chosen else VERY_UNLIKELY,
                        "bytes": text.bytes(token, piece), "top_logprobs": tops})
    return content


def prompt_logprobs_json(entries: Sequence[Entry] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank,
    decoded_token}}`` (the first is null)."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
        for entry in entries]


def v2_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], k: int,
                text: TokenText) -> list[dict[str, Any] | None]:
    """Our v2 layout, one object per token (``None`` where nothing predicts the token):
    ``{token_id, token, logprob, rank, top_logprobs: [{token_id, token, logprob, rank}]}``."""
    result: list[dict[str, Any] | None] = []
    for token, entry in zip(token_ids, entries):
        chosen = entry.get(token) if entry else None
        if chosen is None or entry is None:
            result.append(None)
            continue
        result.append({
            "token_id": token, "token": text.text(token, entry),
            "logprob": finite(chosen.logprob), "rank": chosen.rank,
            "top_logprobs": [{"token_id": tid, "token": text.text(tid, entry),
                              "logprob": finite(lp.logprob), "rank": lp.rank}
                             for tid, lp in _tops(entry, k)]})
    return result
