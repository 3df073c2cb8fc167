"""The store of a quantized KV cache on CUDA as one Triton kernel (kernels/kserve_paged_kernels/kv_quant.py's
`store_kv_quant`, code for code).

Why: the PyTorch store is a dozen indexed ops per K/V half and layer, and it reads on the host
which blocks grew (a sync per layer), so a decode step with a quantized cache could not be
captured in a CUDA graph. This is one launch with no host sync.

One program per row; only the first row of a block's run does the work, for every row of the
run: rows that go to one block are adjacent in a call (a block is written by the one sequence
that owns it, its new tokens consecutive), which the kernel relies on, so no two programs touch
a block and nothing needs atomics. That program, per K/V half:
- starts the block afresh (old scale 0) when one of its rows is the block's first slot;
- takes the new scale per KV head as the largest of the old one and the rows' |x| / qmax;
- requantizes the block's codes of each head whose scale grew (`code * old / new`, rounded);
- writes the new scales, then encodes its rows.

Codes are bytes: int8 rounds to nearest even (the 1.5 * 2^23 trick: exact for |x| < 2^22);
fp8 (e4m3fn, e5m2) is encoded by its bits, rounding to nearest even as torch's cast and
clamped to the format's range first, and widened exactly (an e5m2 byte is the top of an IEEE
half; an e4m3 byte shifted into a half is its value times 2^-8).

Bit for bit with torch on a GPU too: the divisions are `tl.math.div_rn` (a plain `/` is an
approximate division on CUDA) and the launch turns FMA contraction off, as torch rounds each
product (tests/kernels/test_gpu_arithmetic.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kserve_paged_kernels.kv_quant import QMAX, QuantKV

__all__ = ["store_kv_quant_triton"]

_FMT = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + M - M rounds to an integer, ties to even


@triton.jit
def _to_fp8(x, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr):
    """fp32 x (|x| <= the format's largest value) -> its fp8 code bits, nearest even; SUB is
    2^(BIAS - 1 + MBITS), the format's smallest step below its normal range to the -1."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23).to(tl.int32) - 127
    steps = (tl.abs(x) * SUB + _MAGIC) - _MAGIC  # below the normal range
    shift: tl.constexpr = 23 - MBITS
    r = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)
    r = (r >> shift) - ((127 - BIAS) << MBITS)
    code = tl.where(e < 1 - BIAS, steps.to(tl.uint32), r)
    return tl.where(a == 0, 0, code) | sign


@triton.jit
def _encode(x, FMT: tl.constexpr, QMAX: tl.constexpr):
    """x already divided by its scale -> code bytes (clamped to +-QMAX)."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    if FMT == 0:
        return ((x + _MAGIC) - _MAGIC).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    elif FMT == 1:
        return _to_fp8(x, 3, 7, 512.0).to(tl.uint8)
    else:
        return _to_fp8(x, 2, 15, 65536.0).to(tl.uint8)


@triton.jit
def _decode(b, FMT: tl.constexpr):
    """Code bytes -> their values over the scale, exactly."""
    if FMT == 0:
        return b.to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 1:
        h = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store_half(x_ptr, stride_xt, stride_xh, code_ptr, scale_ptr, slot_ptr, t, num_tokens, blk,
                num_kv_heads, head_dim, stride_cblk, stride_coff, stride_ch,
                BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                FMT: tl.constexpr, QMAX: tl.constexpr):
    """One K or V half of the block run starting at row t (module docstring)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    hmask = h < num_kv_heads
    need = tl.zeros([BLOCK_H], dtype=tl.float32)
    fresh = tl.full([], 0, tl.int32)
    for i in range(BLOCK_SIZE):  # the run: rows t .. while their slot is in this block
        r = t + i
        slot = tl.load(slot_ptr + tl.minimum(r, num_tokens - 1)).to(tl.int64)  # r past: `here` 0
        here = (r < num_tokens) & (slot >= 0) & (slot // BLOCK_SIZE == blk)
        rmask = hmask[:, None] & (d < tl.where(here, head_dim, 0))  # the row's, or nothing
        x = tl.load(x_ptr + r * stride_xt + h[:, None] * stride_xh + d, mask=rmask,
                    other=0.0).to(tl.float32)
        need = tl.maximum(need, tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX))
        fresh = fresh | (here & (slot % BLOCK_SIZE == 0)).to(tl.int32)
    old = tl.load(scale_ptr + blk * num_kv_heads + h, mask=hmask, other=0.0)
    old = tl.where(fresh > 0, 0.0, old)
    new = tl.maximum(old, need)
    grow = (new > old) & (old > 0)
    ratio = tl.where(grow, tl.math.div_rn(old, tl.where(grow, new, 1.0)), 1.0)
    gmask = (d < head_dim) & (h[:, None] < tl.where(grow, num_kv_heads, 0)[:, None])
    for s in range(BLOCK_SIZE):  # requantize the heads that grew
        ptr = code_ptr + blk * stride_cblk + s * stride_coff + h[:, None] * stride_ch + d
        c = tl.load(ptr, mask=gmask, other=0)
        tl.store(ptr, _encode(_decode(c, FMT) * ratio[:, None], FMT, QMAX), mask=gmask)
    tl.store(scale_ptr + blk * num_kv_heads + h, new, mask=hmask)
    inv = tl.where(new > 0, tl.math.div_rn(tl.full(new.shape, 1.0, tl.float32),
                                           tl.maximum(new, 1e-30)), 0.0)
    for i in range(BLOCK_SIZE):
        r = t + i
        slot = tl.load(slot_ptr + tl.minimum(r, num_tokens - 1)).to(tl.int64)  # r past: `here` 0
        here = (r < num_tokens) & (slot >= 0) & (slot // BLOCK_SIZE == blk)
        rmask = hmask[:, None] & (d < tl.where(here, head_dim, 0))
        x = tl.load(x_ptr + r * stride_xt + h[:, None] * stride_xh + d, mask=rmask,
                    other=0.0).to(tl.float32)
        ptr = code_ptr + blk * stride_cblk + (slot % BLOCK_SIZE) * stride_coff
        tl.store(ptr + h[:, None] * stride_ch + d, _encode(x * inv[:, None], FMT, QMAX),
                 mask=rmask)


@triton.jit
def _store_quant_kernel(key_ptr, value_ptr, code_ptr, scale_ptr, slot_ptr, num_tokens,
                        stride_kt, stride_kh, stride_vt, stride_vh, stride_ckv, stride_cblk,
                        stride_coff, stride_ch, stride_skv, num_kv_heads, head_dim,
                        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        FMT: tl.constexpr, QMAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    prev = tl.load(slot_ptr + tl.maximum(t - 1, 0)).to(tl.int64)
    first = (t == 0) | (prev < 0) | (prev // BLOCK_SIZE != blk)
    if (slot >= 0) & first:
        _store_half(key_ptr, stride_kt, stride_kh, code_ptr, scale_ptr, slot_ptr, t, num_tokens,
                    blk, num_kv_heads, head_dim, stride_cblk, stride_coff, stride_ch,
                    BLOCK_SIZE, BLOCK_H, BLOCK_D, FMT, QMAX)
        _store_half(value_ptr, stride_vt, stride_vh, code_ptr + stride_ckv,
                    scale_ptr + stride_skv, slot_ptr, t, num_tokens, blk, num_kv_heads,
                    head_dim, stride_cblk, stride_coff, stride_ch, BLOCK_SIZE, BLOCK_H,
                    BLOCK_D, FMT, QMAX)


def store_kv_quant_triton(key: torch.Tensor, value: torch.Tensor, kv: QuantKV,
                          slot_mapping: torch.Tensor) -> None:
    """`store_kv_quant` in one launch (rows of a block adjacent: module docstring)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    codes, scales = kv.data.view(torch.uint8), kv.scales
    if not codes.is_contiguous() or not scales.is_contiguous():
        raise ValueError("a quantized KV cache must be contiguous")
    _store_quant_kernel[(num_tokens,)](
        key, value, codes, scales, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3), scales.stride(0),
        num_kv_heads, head_dim, BLOCK_SIZE=codes.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FMT=_FMT[kv.dtype], QMAX=QMAX[kv.dtype], enable_fp_fusion=False)
