"""The CPU backend over a quantized KV cache: dequantize what the step reads, then the usual kernels.

The native C kernels read float32 and bf16 caches only. Rather than a third variant of each
(row kernel, transposed-key tiles, shared-prefix paths, at every ISA level), each layer
dequantizes the blocks its step's sequences reference into a compact float cache (in the
query's dtype) and runs `paged_attention_cpu` over it with the block tables renumbered. The
block set and renumbering depend only on the step's metadata, so the first layer derives them
and keeps them in the step's `plan` (like the CPU backend's own plan); every layer then pays one
dequantizing pass over its own codes, the bytes attention reads anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_backend import bidirectional_attention_cpu, paged_attention_cpu
from kernels.kv_quant import QuantKV, dequantize
from kernels.metadata import AttentionMetadata

__all__ = ["attention_quant_cpu"]


@dataclass(slots=True)
class _Compact:
    blocks: torch.Tensor  # int64 [n]: the physical blocks the step reads, ascending
    meta: AttentionMetadata  # the step with its block tables renumbered into 0..n-1


def _compact(meta: AttentionMetadata, block_size: int) -> _Compact:
    """The step's blocks and renumbered metadata, derived once per step (kept in `plan`)."""
    key = ("kvq_compact", block_size)
    if meta.plan is None:
        meta.plan = {}
    if key in meta.plan:
        return meta.plan[key]
    tables = meta.block_tables.long()
    needed = (meta.seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(tables.shape[1], device=tables.device).unsqueeze(0) < needed.unsqueeze(1)
    blocks, inverse = torch.unique(tables[used], return_inverse=True)
    renumbered = torch.zeros_like(meta.block_tables)
    renumbered[used] = inverse.to(renumbered.dtype)
    step = AttentionMetadata(meta.slot_mapping, renumbered, meta.seq_lens, meta.query_start_loc,
                             meta.max_seq_len, meta.max_query_len, row_lens=meta.row_lens,
                             row_seq_idx=meta.row_seq_idx, backend=meta.backend)
    meta.plan[key] = _Compact(blocks, step)
    return meta.plan[key]


def attention_quant_cpu(query: torch.Tensor, kv: QuantKV, meta: AttentionMetadata, scale: float,
                        *, window: int | None = None, softcap: float | None = None,
                        causal: bool = True) -> torch.Tensor:
    """`paged_attention_cpu` (or the bidirectional form) over the dequantized blocks."""
    dtype = query.dtype if query.dtype in (torch.float32, torch.bfloat16) else torch.float32
    compact = _compact(meta, kv.data.shape[2])
    if compact.blocks.numel() == 0:
        return torch.zeros_like(query)
    cache = dequantize(kv, compact.blocks, dtype)
    if not causal:
        return bidirectional_attention_cpu(query, cache, compact.meta, scale).to(query.dtype)
    out = paged_attention_cpu(query, cache, compact.meta, scale, window=window, softcap=softcap)
    return out.to(query.dtype)
