"""Log-probabilities kept per request: of each sampled token and of each prompt token.

Rows come with what the request asked for (how many top tokens), not with the request: the
sampler's side knows nothing of requests and queues."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kserve_paged_engine.outputs import Logprob
from kserve_paged_engine.sample.logits_processors import top_logprobs

Decode = Callable[[list[int]], str]


@dataclass(slots=True)
class PromptSpan:
    """One request's prompt positions in a step: `count` logits rows from position `start`,
    whose entries go to `kept` (position -> entry), top `k` tokens each."""

    prompt_token_ids: Sequence[int]
    k: int
    start: int
    count: int
    kept: dict[int, dict[int, Logprob]]


def _entry(token: int, chosen: float, rank: int, tops: Sequence[tuple[int, float]],
           decode: Decode) -> dict[int, Logprob]:
    """The chosen token first, then the top ones that are not it, with their ranks."""
    entry = {token: Logprob(chosen, rank, decode([token]))}
    for r, (tid, value) in enumerate(tops, 1):
        if tid not in entry:
            entry[tid] = Logprob(value, r, decode([tid]))
    return entry


def sampled_entries(logits: torch.Tensor, tokens: torch.Tensor, wanted: Sequence[int | None],
                    decode: Decode) -> list[tuple[int, dict[int, Logprob], float]]:
    """(row, entry, chosen token's logprob) for each row whose request asked for logprobs
    (`wanted[row]`: its top-k, None: none), of the raw model logits (as vLLM returns them by
    default)."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    k = max(wanted[i] or 0 for i in rows)
    chosen, tops, ranks = top_logprobs(logits.index_select(0, index),
                                       tokens.index_select(0, index), k)
    out = []
    for j, i in enumerate(rows):
        out.append((i, _entry(int(tokens[i]), chosen[j], ranks[j], tops[j][:wanted[i]], decode),
                    chosen[j]))
    return out


def record_prompt(logits: torch.Tensor, spans: Sequence[PromptSpan], decode: Decode) -> None:
    """Position p's logits score prompt token p + 1; each position is kept once (a preempted
    request recomputes its prompt)."""
    row = 0
    for span in spans:
        start, count = span.start, span.count
        targets = torch.tensor(span.prompt_token_ids[start + 1:start + 1 + count],
                               device=logits.device)
        chosen, tops, ranks = top_logprobs(logits[row:row + count], targets, span.k)
        row += count
        for j in range(count):
            position = start + 1 + j
            if position not in span.kept:
                span.kept[position] = _entry(int(targets[j]), chosen[j], ranks[j], tops[j],
                                             decode)
