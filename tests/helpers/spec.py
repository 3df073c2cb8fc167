"""What the speculative-decoding tests share: a repetitive workload (the answer repeats the
input, which prompt lookup predicts), runs that record every schedule, and a distribution
distance."""

from __future__ import annotations

from collections import Counter

import torch

from tests.helpers.tiny_models import VOCAB


def total_variation(counts: Counter, probs: torch.Tensor, total: int) -> float:
    return 0.5 * sum(abs(counts.get(t, 0) / total - float(probs[t]))
                     for t in range(probs.numel()))


def repetitive_prompts(n: int = 6) -> list[list[int]]:
    """Extraction/editing style: a passage, then the start of it again, so the answer repeats
    the input (a tiny random model also falls into loops, which prompt lookup predicts)."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for size in (14, 22, 9, 30, 17):
        passage = torch.randint(3, VOCAB, (size,), generator=g).tolist()
        prompts.append(passage + [2] + passage[:size // 2])
    prompts.append(prompts[1][:20] + [5, 6, 7])  # shares prompt 1's leading blocks
    return prompts[:n]


def run_recording_steps(llm, prompts, params):
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out)
        return out

    llm.engine.scheduler.schedule = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, steps


def sample_tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]
