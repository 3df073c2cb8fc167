"""The CPU backend over a quantized KV cache: the native kernel over the codes, else dequantize.

Causal attention goes to `cpu_native.paged_rows_q8` (csrc/paged_q8.c) wherever the library is
loaded: decode rows read the one-byte codes and their scales directly, and a prefill chunk's
rows run the fp32 key tiles over their sequence's blocks dequantized once in C. The query is
taken in fp32 (a bf16 model's query is widened, its output rounded back once).

Otherwise (no native library, bidirectional attention) each layer dequantizes the blocks its
step's sequences reference into a compact float cache (in the query's dtype) and runs
`paged_attention_cpu` over it with the block tables renumbered. The block set and renumbering
depend only on the step's metadata, so the first layer derives them and keeps them in the
step's `plan` (like the CPU backend's own plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_backend import bidirectional_attention_cpu, paged_attention_cpu
from kserve_paged_kernels.kv_quant import QuantKV, dequantize
from kserve_paged_kernels.metadata import AttentionMetadata

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
                        causal: bool = True, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the codes (native), or `paged_attention_cpu` (or the bidirectional
    form) over the dequantized blocks. Attention sinks take the dequantized form (the native
    float kernel has them; the one over the codes does not)."""
    if causal and sinks is None and cpu_native.kvq_usable(query, kv.data, kv.scales):
        return _native(query, kv, meta, scale, window, softcap)
    dtype = query.dtype if query.dtype in (torch.float32, torch.bfloat16) else torch.float32
    compact = _compact(meta, kv.data.shape[2])
    if compact.blocks.numel() == 0:
        return torch.zeros_like(query)
    cache = dequantize(kv, compact.blocks, dtype)
    if not causal:
        return bidirectional_attention_cpu(query, cache, compact.meta, scale).to(query.dtype)
    out = paged_attention_cpu(query, cache, compact.meta, scale, window=window, softcap=softcap,
                              sinks=sinks)
    return out.to(query.dtype)


def _native(query: torch.Tensor, kv: QuantKV, meta: AttentionMetadata, scale: float,
            window: int | None, softcap: float | None) -> torch.Tensor:
    """`cpu_native.paged_rows_q8` over the step's valid rows (padding rows come last, zero)."""
    key = ("kvq_rows", query.shape[0])
    if meta.plan is None:
        meta.plan = {}
    if key not in meta.plan:
        valid = int(meta.query_start_loc[-1])
        rows = meta.rows(valid)
        meta.plan[key] = (valid, torch.arange(valid), *rows) if rows is not None else None
    if meta.plan[key] is None:
        raise ValueError("a row of the step belongs to no sequence")
    valid, tok, row_lens, seq_idx = meta.plan[key]
    q = query.float().contiguous()
    out = torch.zeros_like(q) if valid < q.shape[0] else torch.empty_like(q)
    cpu_native.paged_rows_q8(q, kv.data, kv.scales, meta.block_tables, row_lens, tok, seq_idx,
                             scale, out, window=window, softcap=softcap)
    return out.to(query.dtype)
