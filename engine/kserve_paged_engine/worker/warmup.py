"""Warm-up before readiness (issue 32, item 6): every Triton variant the server will launch is
compiled by dummy steps before the engine reports ready, so no request pays a compile.

A variant is a kernel with its compile key (constexprs and tile sizes, dtypes, alignment,
Triton's integer specializations; per-step integers are `do_not_specialize`, so the shapes of
a step do not make new ones). What changes the key in serving is the kind of step: decode-like
tiles or prefill tiles, one KV split or several (a long context), and each layer's window and
soft-cap, which every forward covers (the split count itself is a runtime argument: one
split variant serves every count). So the dummy steps are: decode of 1 and of
`max_num_seqs` sequences over a short and over the longest context, a prefill chunk of
`max_num_batched_tokens`, a short chunk over the longest context (prefill tiles with split
keys, as a speculative verification or a prompt's uncached tail gets), and a mixed step
(decodes with a chunk). Nothing is stored (slots -1); block tables point at block 0. The variants launched are counted
(`kserve_paged_kernels.launches.counting`) and logged with the time taken.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata, GroupedMetadata
from kserve_paged_kernels.launches import counting

logger = logging.getLogger(__name__)

# New tokens of the short chunk: more than 2 per sequence, so prefill tiles (decode tiles take
# at most 2: kernels/kserve_paged_kernels/triton_backend.py's `_tiles`).
SHORT_CHUNK = 3


@dataclass(frozen=True, slots=True)
class WarmupReport:
    variants: set[tuple]
    launches: int
    seconds: float


def warmup_steps(max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """Each dummy step as (new tokens per sequence, context length per sequence)."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    chunk = max(1, min(max_num_batched_tokens, max_model_len))
    mixed = max(1, min(seqs, max_num_batched_tokens // 2))
    rest = max(1, min(max_num_batched_tokens - mixed + 1, max_model_len))
    short = max(1, min(SHORT_CHUNK, max_num_batched_tokens, max_model_len))
    return [([1], [2]), ([1], [max_model_len]),
            ([1] * seqs, [2] * seqs), ([1] * seqs, [max_model_len] * seqs),
            ([chunk], [chunk]), ([short], [max_model_len]),
            ([1] * (mixed - 1) + [rest], [max_model_len] * (mixed - 1) + [rest])]


def _dummy_meta(q_lens: list[int], ctx: list[int], max_blocks: int, device: torch.device,
                backend: str | None, num_groups: int) -> AttentionMetadata:
    total = sum(q_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    fields = dict(
        slot_mapping=torch.full((total,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros(len(q_lens), max_blocks, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_seq_len=max(ctx), max_query_len=max(q_lens), backend=backend)
    if num_groups == 1:
        return AttentionMetadata(**fields)
    return GroupedMetadata(**fields, groups=[AttentionMetadata(**fields)
                                             for _ in range(num_groups - 1)])


def warm_up(model: torch.nn.Module, kv_caches: list[torch.Tensor], max_blocks_per_seq: int,
            device: torch.device, backend: str | None, *, max_num_batched_tokens: int,
            max_num_seqs: int, max_model_len: int, num_groups: int = 1) -> WarmupReport:
    """Run the dummy steps (the model's forward and the logits of every sequence's last row)."""
    t0 = time.monotonic()
    with counting() as count, torch.inference_mode():
        for q_lens, ctx in warmup_steps(max_num_batched_tokens, max_num_seqs, max_model_len):
            meta = _dummy_meta(q_lens, ctx, max_blocks_per_seq, device, backend, num_groups)
            total = sum(q_lens)
            positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx)])
            hidden = model(torch.zeros(total, dtype=torch.long, device=device),
                           positions.to(device), kv_caches, meta)
            if getattr(model, "lm_head", None) is not None:  # pooling models have none
                model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = WarmupReport(count.variants, sum(count.triton.values()), time.monotonic() - t0)
    logger.info("warm-up: %d Triton variants compiled (%d launches) in %.1f s",
                len(report.variants), report.launches, report.seconds)
    return report
