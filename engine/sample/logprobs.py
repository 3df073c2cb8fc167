"""Log-probabilities kept per request: of each sampled token and of each prompt token."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.request import Request
from engine.outputs import Logprob
from engine.sample.logits_processors import top_logprobs

Decode = Callable[[list[int]], str]


def _entry(token: int, chosen: float, rank: int, tops: Sequence[tuple[int, float]],
           decode: Decode) -> dict[int, Logprob]:
    """The chosen token first, then the top ones that are not it, with their ranks."""
    entry = {token: Logprob(chosen, rank, decode([token]))}
    for r, (tid, value) in enumerate(tops, 1):
        if tid not in entry:
            entry[tid] = Logprob(value, r, decode([tid]))
    return entry


def sampled_entries(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sequence[Request],
                    decode: Decode) -> list[tuple[int, dict[int, Logprob], float]]:
    """(row, entry, chosen token's logprob) for each sampling row whose request asked for
    logprobs, of the raw model logits (as vLLM returns them by default)."""
    rows = [i for i, r in enumerate(sampling) if r.sampling_params.logprobs is not None]
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    k = max(sampling[i].sampling_params.logprobs or 0 for i in rows)
    chosen, tops, ranks = top_logprobs(logits.index_select(0, index),
                                       tokens.index_select(0, index), k)
    out = []
    for j, i in enumerate(rows):
        wanted = sampling[i].sampling_params.logprobs
        out.append((i, _entry(int(tokens[i]), chosen[j], ranks[j], tops[j][:wanted], decode),
                    chosen[j]))
    return out


def record_prompt(logits: torch.Tensor, spans: Sequence[tuple[Request, int, int]],
                  kept: Callable[[Request], dict[int, dict[int, Logprob]]],
                  decode: Decode) -> None:
    """Position p's logits score prompt token p + 1; each position is kept once in
    `kept(request)` (a preempted request recomputes its prompt)."""
    row = 0
    for req, start, count in spans:
        positions = kept(req)
        k = req.sampling_params.prompt_logprobs or 0
        targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + count],
                               device=logits.device)
        chosen, tops, ranks = top_logprobs(logits[row:row + count], targets, k)
        row += count
        for j in range(count):
            position = start + 1 + j
            if position not in positions:
                positions[position] = _entry(int(targets[j]), chosen[j], ranks[j], tops[j],
                                             decode)
