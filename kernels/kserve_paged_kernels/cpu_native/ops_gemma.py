"""Gemma's fused elementwise ops (`csrc/gemma_bf16.c` in bf16, `csrc/cpu_ops.c` in fp32).

Why apart from `ops`: in bf16 Gemma rounds where Llama does not. transformers' Gemma norm
normalises in fp32, multiplies by `1 + weight` in fp32 and rounds once, where Llama's rounds the
normalised value before a bf16 weight multiply; so these take the norm weight as fp32 `1 + w`
(kept once at packing: `GemmaRMSNorm.pack`), for fp32 and bf16 rows alike. In fp32 the two
orders are one computation and the fp32 kernels run. GeGLU's tanh-GELU-and-multiply rounds the
GELU to bf16 before the multiply, as torch's two bf16 ops do. The convention for "cannot run
here" is the package's: None, nothing done.
"""

from __future__ import annotations

from typing import Literal

import torch

from kserve_paged_kernels.cpu_native.loader import load, sync_threads
from kserve_paged_kernels.cpu_native.ops import rows_of

_ROWS = (torch.float32, torch.bfloat16)


def _offset_ok(w: torch.Tensor, n: int) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
            and tuple(w.shape) == (n,))


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None,
                       offset_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Gemma's `norm(x (+ residual))` in one pass, `residual` updated in place to the sum
    (rounded to the rows' dtype, as torch's add): rows fp32 or bf16, `offset_weight` the fp32
    `1 + weight`; the normalised row times it in fp32, rounded once. None: not in the
    kernel's layout."""
    lib = load()
    dt = x.dtype
    if (lib is None or dt not in _ROWS or not rows_of(x, dt)
            or not _offset_ok(offset_weight, x.shape[1])
            or (residual is not None and (not residual.is_contiguous() or residual.dtype != dt
                                          or residual.shape != x.shape))):
        return None
    out = torch.empty(x.shape, dtype=dt)
    sync_threads(lib)
    fn = lib.kp_add_rms_norm_f32 if dt == torch.float32 else lib.kp_add_rms_norm_gemma_bf16
    fn(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
       offset_weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def gemma_qk_norm_inplace(qkv: torch.Tensor, q_heads: int, k_heads: int, head_dim: int,
                          q_offset: torch.Tensor, k_offset: torch.Tensor,
                          eps: float) -> Literal[True] | None:
    """Gemma 3's per-head q/k norm in place on fused qkv rows (fp32 or bf16): the first
    `q_heads` heads times `q_offset`, the next `k_heads` times `k_offset` (fp32 `1 + w`),
    each head rounded as `gemma_add_rms_norm` rounds a row. True, or None: nothing done."""
    lib = load()
    dt = qkv.dtype
    if (lib is None or dt not in _ROWS or not rows_of(qkv, dt)
            or qkv.shape[1] < (q_heads + k_heads) * head_dim
            or not all(_offset_ok(w, head_dim) for w in (q_offset, k_offset))):
        return None
    sync_threads(lib)
    fn = lib.kp_qk_norm_f32 if dt == torch.float32 else lib.kp_qk_norm_gemma_bf16
    fn(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], q_heads, k_heads, head_dim,
       q_offset.data_ptr(), k_offset.data_ptr(), eps)
    return True


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`gelu_tanh(gate) * up` of a fused bf16 `[rows, 2 * inter]` projection (gate first), the
    GELU rounded to bf16 before the multiply as in eager bf16; None when not applicable (fp32
    GeGLU runs inside the GEMM: `gemm_gelu`)."""
    lib = load()
    if (lib is None or not rows_of(gate_up, torch.bfloat16) or not gate_up.is_contiguous()
            or gate_up.shape[1] % 2):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=torch.bfloat16)
    sync_threads(lib)
    lib.kp_gelu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out
