"""MXFP4 weights times float rows in one Triton launch (CUDA; the interpreter in tests), the
weights decoded inside the K loop (`kserve_paged_kernels.mxfp4` says the format).

Why: gpt-oss's experts are nearly all of its weights; kept 4-bit, a matmul that decodes its
tile of weight bytes in registers reads half a byte a value from memory and never writes a
float copy. A program owns a BLOCK_M x BLOCK_N output tile; per BLOCK_K step it loads the
rows' even and odd columns separately (the low and high nibbles of one byte are the even and
odd column), decodes both nibbles through the 16-entry E2M1 table times the group's power of
two, and accumulates two float32 dots. out = x @ W.T + bias, in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kserve_paged_kernels import mxfp4

__all__ = ["mxfp4_linear_triton"]


@triton.jit
def _mxfp4_linear_kernel(x_ptr, blk_ptr, scl_ptr, bias_ptr, lut_ptr, out_ptr, M, N, K,
                         stride_xm, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    half = tl.arange(0, BLOCK_K // 2)  # byte j of the step: columns 2j (low) and 2j + 1 (high)
    groups = K // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        byte = k0 // 2 + half  # byte index along the row
        k_ok = byte < K // 2
        x_even = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (2 * byte)[None, :],
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (2 * byte + 1)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        codes = tl.load(blk_ptr + rn[:, None].to(tl.int64) * (K // 2) + byte[None, :],
                        mask=w_mask, other=0).to(tl.int32)
        exps = tl.load(scl_ptr + rn[:, None].to(tl.int64) * groups + (byte // 16)[None, :],
                       mask=w_mask, other=127).to(tl.int32)
        scale = tl.exp2((exps - 127).to(tl.float32))
        w_lo = tl.load(lut_ptr + (codes & 15)) * scale
        w_hi = tl.load(lut_ptr + (codes >> 4)) * scale
        acc += tl.dot(x_even, tl.trans(w_lo), input_precision="ieee")
        acc += tl.dot(x_odd, tl.trans(w_hi), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_linear_triton(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T + bias` -> `[M, N]` in x's dtype, W's N rows given as MXFP4 `blocks
    [N, K / 32, 16]` / `scales [N, K / 32]`."""
    mxfp4.check_shapes(blocks, scales)
    n, groups = scales.shape
    k = groups * mxfp4.GROUP
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {k} columns")
    x = x if x.stride(-1) == 1 else x.contiguous()
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return out
    lut = torch.tensor(mxfp4.E2M1, dtype=torch.float32, device=x.device)
    block_m, block_n, block_k = 16, 32, 64
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _mxfp4_linear_kernel[grid](
        x, blocks, scales, bias if bias is not None else out, lut, out, x.shape[0], n, k,
        x.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
