"""Absorbed multi-head latent attention over the paged latent cache, in Triton (a first kernel).

The layout is mla_reference.py's: a latent row of D values per token, its first half in the
cache's K plane and its second half in the V plane (one "KV head" of D / 2). One program per
(attention row, query head): a row is one new token of a sequence, seeing `row_lens[row]` keys
of the sequence `row_seq_idx[row]` (AttentionMetadata.rows: causality and chunked prefill in
one number). It walks the row's keys one cache block at a time through the block table, scores
each latent row against the latent-space query (both halves), and accumulates the value, the
latent's first `value_dim` values (the compressed KV: all of the K half, the start of the V
half), with an online softmax in fp32. Output `[rows, heads, value_dim]` float32, as
`mla_reference.attend_latent`. Checked against it in Triton's interpreter
(tests/kernels/test_mla_reference.py). The model (models/mla.py) runs it for a step whose
sequences all take the absorbed path where Triton runs (CUDA, or the interpreter with the
triton backend forced); not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kserve_paged_kernels.metadata import AttentionMetadata

__all__ = ["mla_absorbed_triton"]


@triton.jit
def _mla_absorbed_kernel(q_ptr, cache_ptr, bt_ptr, row_lens_ptr, row_seq_ptr, out_ptr, scale,
                         half, value_rest, stride_qt, stride_qh, stride_ckv, stride_cblk,
                         stride_coff, stride_bt, stride_ot, stride_oh,
                         BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    n_keys = tl.load(row_lens_ptr + row)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_half = d < half
    q_base = q_ptr + row * stride_qt + head * stride_qh
    q0 = tl.load(q_base + d, mask=in_half, other=0.0).to(tl.float32)
    q1 = tl.load(q_base + half + d, mask=in_half, other=0.0).to(tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)  # fp32 scalars
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc0 = tl.zeros([BLOCK_D], tl.float32)
    acc1 = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n_keys, BLOCK_SIZE):
        blk = tl.load(bt_ptr + seq * stride_bt + start // BLOCK_SIZE).to(tl.int64)
        live = start + offs < n_keys
        rows = cache_ptr + blk * stride_cblk + offs[:, None] * stride_coff + d[None, :]
        mask = live[:, None] & in_half[None, :]
        k0 = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
        k1 = tl.load(rows + stride_ckv, mask=mask, other=0.0).to(tl.float32)
        s = (tl.sum(k0 * q0[None, :], axis=1) + tl.sum(k1 * q1[None, :], axis=1)) * scale
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc0 = acc0 * alpha + tl.sum(p[:, None] * k0, axis=0)
        acc1 = acc1 * alpha + tl.sum(p[:, None] * k1, axis=0)
        m_i = m_new
    out = out_ptr + row * stride_ot + head * stride_oh
    tl.store(out + d, acc0 / l_i, mask=in_half)
    tl.store(out + half + d, acc1 / l_i, mask=d < value_rest)


def mla_absorbed_triton(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        value_dim: int, scale: float) -> torch.Tensor:
    """Absorbed MLA of every row: q `[T, H, D]` (latent-space query, then its RoPE part) over
    the paged latent rows -> `[T, H, value_dim]` float32. `value_dim` (kv_lora_rank) must
    reach past the K half (it always does: kv_lora_rank > qk_rope_head_dim)."""
    rows = meta.rows(q.shape[0])
    if rows is None:
        raise ValueError("every row must belong to a sequence (no padding rows)")
    row_lens, row_seq = rows
    t, heads, width = q.shape
    half = kv_cache.shape[-1]
    if width != 2 * half or not half <= value_dim <= width:
        raise ValueError(f"query width {width}, latent halves of {half}, value_dim {value_dim}")
    q = q.contiguous()
    out = torch.empty(t, heads, value_dim, dtype=torch.float32, device=q.device)
    tables = meta.block_tables
    if t:
        _mla_absorbed_kernel[(t, heads)](
            q, kv_cache, tables, row_lens, row_seq, out, scale, half, value_dim - half,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_SIZE=kv_cache.shape[2], BLOCK_D=triton.next_power_of_2(half))
    return out
