"""Penalties and logit bias: what a request's history does to its next-token logits.

Semantics (those of vLLM and OpenAI), applied in this order to the raw logits of a row:
- repetition_penalty r: every token seen in the prompt or the output so far has its logit
  divided by r when positive and multiplied by r otherwise (r > 1 discourages repeats);
- frequency_penalty f: minus f times the token's count in the output so far;
- presence_penalty p: minus p for each token that occurs in the output so far;
- logit_bias: the given value added to the given token ids (ids beyond the vocabulary ignored);
- allowed_token_ids: every other token at -inf;
- bad words: a word's token sequence is never completed: its last token is at -inf whenever the
  output so far ends with the tokens before it (one-token words: always). Each word counts as
  written alone and after a space, when that is another tokenization (`bad_words_token_ids`).
Only rows that ask for any of these are touched; the others cost nothing. The last three come
from client lists of any length: they are applied in their prepared form (token_filters.py),
whose cost per step does not grow with the lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kserve_paged_engine.sample.token_filters import prepared
from kserve_paged_engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]
                    ) -> torch.Tensor:
    """Return logits `[N, V]` with each row's penalties and bias applied (a copy if changed)."""
    rows = [i for i, p in enumerate(params) if p.needs_logits_processing]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    device = logits.device
    for i in rows:
        p = params[i]
        row = logits[i]
        out = torch.tensor(list(output_ids[i]), dtype=torch.long, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(list(prompt_ids[i]), dtype=torch.long, device=device)] = True
            if out.numel():
                seen[out] = True
            r = p.repetition_penalty
            row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        if (p.frequency_penalty or p.presence_penalty) and out.numel():
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids:
            prepared(p, vocab, device, row.dtype).apply(row, output_ids[i])
    return logits


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[list[float], list[list[tuple[int, float]]], list[int]]:
    """Log-probabilities of the raw logits: the chosen token's, the top k, and its rank.

    Rank 1 is the most likely token, as in vLLM's outputs.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(lp.shape[0])]
    if k > 0:
        vals, idx = lp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return chosen.tolist(), tops, ranks.tolist()
