"""Triton SGMV kernels for the batched multi-LoRA delta: shrink (x @ A.T) and expand
(out += scale * y @ B.T), over the rows of one step grouped by adapter.

Layout. The adapters of a step sit in slots of stacked weights, `a_stack [slots, rank, in]` and
`b_stack [slots, out, rank]`, zero-padded to the largest rank (a padded rank adds zeros), with
one `scales [slots]`. The step's adapted rows are `rows [n]` (indices into x and out), grouped
by adapter into segments `seg_start / seg_len / seg_slot [S]`. A program owns one segment and a
tile of BLOCK_M of its rows (and, in expand, BLOCK_N output columns): it reads its slot's A or B
once per tile, so rows of one adapter share the weight reads (SGMV; a decode step with one row
per request is the BGMV case of segments of length 1). The rank dimension is padded to
BLOCK_R >= 16 for tl.dot; the intermediate `y [n, BLOCK_R]` stays in float32.

`kserve_paged_kernels.reference.lora_sgmv_ref` is the definition these are tested against (in Triton's
interpreter on CPU, `tests/kernels/test_lora_triton.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, y_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   in_features, rank, stride_xt, stride_as, stride_ar, stride_yt,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    if tile * BLOCK_M < length:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < length
        row = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < in_features
            x = tl.load(x_ptr + row[:, None] * stride_xt + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                        mask=k_ok[:, None] & (r[None, :] < rank), other=0.0)  # [K, R] = A.T
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
        tl.store(y_ptr + (start + m)[:, None] * stride_yt + r[None, :], acc,
                 mask=m_ok[:, None])


@triton.jit
def _expand_kernel(y_ptr, b_ptr, out_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   scales_ptr, out_features, rank, stride_yt, stride_bs, stride_bo, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    col = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    if tile * BLOCK_M < length:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        scale = tl.load(scales_ptr + slot)
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < length
        row = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < out_features
        y = tl.load(y_ptr + (start + m)[:, None] * stride_yt + r[None, :],
                    mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bo + r[:, None],
                    mask=(r[:, None] < rank) & n_ok[None, :], other=0.0)  # [R, N] = B.T
        delta = tl.dot(y, b.to(tl.float32)) * scale
        ptrs = out_ptr + row[:, None] * stride_ot + n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        base = tl.load(ptrs, mask=ok, other=0.0)
        tl.store(ptrs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=ok)


def lora_sgmv(x: torch.Tensor, out: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              scales: torch.Tensor, rows: torch.Tensor, seg_start: torch.Tensor,
              seg_len: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int) -> None:
    """out[rows of segment s] += scales[slot] * (x[rows] @ A[slot].T) @ B[slot].T, in place.

    x `[T, in]`, out `[T, out]` (rows contiguous); a_stack `[slots, rank, in]`, b_stack
    `[slots, out, rank]`; rows / seg_* int tensors on x's device; `max_seg_len` the longest
    segment (a host value, so the grid needs no sync). Rows must be distinct (each row is
    written by one program)."""
    n, num_segs = rows.numel(), seg_start.numel()
    if n == 0 or num_segs == 0:
        return
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out must be contiguous in their last dimension")
    a_stack, b_stack = a_stack.contiguous(), b_stack.contiguous()
    rank, in_features = a_stack.shape[1], a_stack.shape[2]
    out_features = b_stack.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_m = 16
    y = torch.empty(n, block_r, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(max_seg_len, block_m)
    _shrink_kernel[(num_segs, tiles)](
        x, a_stack, y, rows, seg_start, seg_len, seg_slot, in_features, rank,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_K=64, BLOCK_R=block_r)
    block_n = 64
    _expand_kernel[(num_segs, tiles, triton.cdiv(out_features, block_n))](
        y, b_stack, out, rows, seg_start, seg_len, seg_slot, scales.float(), out_features, rank,
        y.stride(0), b_stack.stride(0), b_stack.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
