"""Residual add + RMSNorm in one Triton launch (CUDA), for Llama's `w * x` and Gemma's
`(1 + w) * x` norms.

Why: eagerly the pair is 8-9 launches (add, cast, square, mean, add eps, rsqrt, two multiplies,
cast back), each a pass over the hidden rows; fused it is one pass that reads x and the residual
once and writes the sum and the normed rows. A program owns one row (the grid is the row count,
so no per-step integer reaches the kernel and each model compiles one variant per dtype and
flag set). The sum is rounded to the input dtype before it is normed, the mean square is taken in
float32, and the output rounds as transformers does (`kserve_paged_kernels.reference.add_rms_norm_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm_triton"]


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, hidden,
                         eps, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        y = xf * rstd * (1.0 + w)
    else:
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def usable(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """2-D rows with unit column stride, one dtype for x, residual and (Llama) weight."""
    return (x.dim() == 2 and x.stride(-1) == 1 and weight.dim() == 1
            and weight.shape[0] == x.shape[1] and weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                      and residual.dtype == x.dtype)))


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, *, gemma: bool = False) -> torch.Tensor:
    """`norm(x + residual)`, `residual` updated in place to the sum (`norm(x)` without one).

    Llama's norm returns `weight * normed` in the promoted dtype, as torch's multiply does (so
    an fp32 weight over bf16 rows gives fp32); Gemma's returns x's dtype."""
    rows, hidden = x.shape
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK=block,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out
