"""RoPE on fused qkv rows, in place, with the K/V store into the paged cache in the same launch
(CUDA).

Why: eagerly RoPE is ~16 launches (gather cos/sin, split, four multiplies, add, sub, cat, for
q and k) plus the copy of v and the store; here a program owns one token: it reads the row's
position and its cos/sin row once, rotates every q and k head of the row in place (rotate-half
layout, the pairs `(d, d + head_dim / 2)`), and, when its slot is >= 0, writes the rotated k
heads and the v heads into the cache (`[2, num_blocks, block_size, kv_heads, head_dim]`,
`kernels/kserve_paged_kernels/triton_backend.py`'s layout), so k and v are never read again before attention.
Slots < 0 (padding rows) are rotated but not stored. Each product and the sum are rounded to
the rows' dtype as torch's elementwise ops round them (`kserve_paged_kernels.reference.rope_ref`), so bf16
results match the eager path; the launch turns FMA contraction off, so on a GPU a float32
product is not fused into the sum either (bit-exact: tests/kernels/test_gpu_arithmetic.py). The token count is the grid and positions come from a tensor:
no per-step integer reaches the kernel, so each model compiles one variant per dtype.
Positions must lie inside the cos/sin table (the engine caps them at max_model_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_store_triton"]


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, stride_t,
                       stride_cos, stride_ckv, stride_cblk, stride_coff, stride_ch, num_heads,
                       num_kv_heads, HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, STORE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_P2)
    d_ok = d < half
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    h = tl.arange(0, BLOCK_H)[:, None]
    ok = (h < num_heads + num_kv_heads) & d_ok[None, :]
    row = qkv_ptr + tok * stride_t
    p1 = row + h * HEAD_DIM + d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + half, mask=ok, other=0.0)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # Each product rounded to the rows' dtype before the sum, as torch rounds them.
    o1 = ((a1 * cos[None, :]).to(dt).to(tl.float32)
          - (a2 * sin[None, :]).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * cos[None, :]).to(dt).to(tl.float32)
          + (a1 * sin[None, :]).to(dt).to(tl.float32)).to(dt)
    tl.store(p1, o1, mask=ok)
    tl.store(p1 + half, o2, mask=ok)
    if STORE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            base = cache_ptr + (slot // BLOCK_SIZE) * stride_cblk + (slot % BLOCK_SIZE) * stride_coff
            kh = tl.maximum(h - num_heads, 0)
            k_ok = ok & (h >= num_heads)
            k_dst = base + kh * stride_ch + d[None, :]
            ety = cache_ptr.dtype.element_ty
            tl.store(k_dst, o1.to(ety), mask=k_ok)
            tl.store(k_dst + half, o2.to(ety), mask=k_ok)
            vh = tl.arange(0, BLOCK_KV)[:, None]
            vd = tl.arange(0, BLOCK_D)[None, :]
            v_ok = (vh < num_kv_heads) & (vd < HEAD_DIM)
            v = tl.load(row + (num_heads + num_kv_heads + vh) * HEAD_DIM + vd, mask=v_ok)
            tl.store(base + stride_ckv + vh * stride_ch + vd, v.to(ety), mask=v_ok)


def usable(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor | None,
           slot_mapping: torch.Tensor | None = None) -> bool:
    """Rows with unit column stride holding q, k and v heads of head_dim = 2 * cos.shape[1]
    (even), one position per row, cos and sin tables of one shape and layout, and (with a
    cache) a cache of that head_dim and KV head count, contiguous in it, and one slot per
    row."""
    head_dim = 2 * cos.shape[-1]
    if kv_cache is not None and (slot_mapping is None or slot_mapping.dim() != 1
                                 or slot_mapping.shape[0] != qkv.shape[0]):
        return False
    return (qkv.dim() == 2 and qkv.stride(-1) == 1 and cos.stride(-1) == 1
            and sin.shape == cos.shape and sin.stride() == cos.stride()
            and qkv.shape[1] >= (num_heads + 2 * num_kv_heads) * head_dim
            and positions.dim() == 1 and positions.shape[0] == qkv.shape[0]
            and (kv_cache is None or (kv_cache.shape[-1] == head_dim
                                      and kv_cache.shape[3] == num_kv_heads
                                      and kv_cache.stride(-1) == 1)))


def rope_store_triton(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                      kv_cache: torch.Tensor | None = None,
                      slot_mapping: torch.Tensor | None = None) -> None:
    """Rotate the q and k heads of `qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]` in
    place by `positions [T]` (tables `cos`/`sin [max_positions, head_dim / 2]`); with
    `kv_cache` and `slot_mapping [T]` also store each row's rotated k and its v at its slot
    (slot < 0: skipped)."""
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    head_dim = 2 * cos.shape[1]
    store = kv_cache is not None and slot_mapping is not None
    cache = kv_cache if store else qkv
    slots = slot_mapping if store else positions
    strides = (cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)) if store \
        else (0, 0, 0, 0)
    _rope_store_kernel[(num_tokens,)](
        qkv, positions, cos, sin, cache, slots, qkv.stride(0), cos.stride(0), *strides,
        num_heads, num_kv_heads, HEAD_DIM=head_dim,
        HALF_P2=triton.next_power_of_2(head_dim // 2),
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.shape[2] if store else 1, STORE=store,
        num_warps=4 if (num_heads + num_kv_heads) * head_dim <= 4096 else 8,
        enable_fp_fusion=False)  # torch rounds each product: no FMA (bit-exact)
