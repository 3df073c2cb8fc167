"""SiLU-and-multiply (SwiGLU) and tanh-GELU-and-multiply (Gemma's GeGLU) over a fused gate/up
projection, in one Triton launch (CUDA).

Why: eagerly it is a split plus two launches (the activation, then the multiply) with a
full-size temporary between them; fused, each element of gate and up is read once and the
product written once. A program owns BLOCK columns of one row; the grid is (rows, column
blocks), so no per-step integer reaches the kernel. The activation is computed in float32 and
rounded to the rows' dtype before the multiply, as torch's two ops round it
(`kserve_paged_kernels.reference.act_mul_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["act_mul_triton"]

BLOCK = 1024


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, GELU: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inter
    g = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + col, mask=ok, other=0.0)
    if GELU:
        # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh from exp (exact at both ends)
        t = tl.exp(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))
        a = 0.5 * g * (2.0 - 2.0 / (t + 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(u.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def usable(gate_up: torch.Tensor) -> bool:
    """2-D rows of an even width with unit column stride."""
    return gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0


def act_mul_triton(gate_up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """`act(gate) * up` for `gate_up [rows, 2 * inter]` (gate first) -> `[rows, inter]`."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _act_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block,
        num_warps=4)
    return out
