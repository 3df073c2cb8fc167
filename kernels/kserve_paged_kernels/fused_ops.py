"""A decoder layer's fused elementwise ops, on whichever kernel can run them here.

The engine's layers call these and fall back to their eager PyTorch code on None / False, so a
layer holds one line per op and the choice of kernel lives here:
- CUDA: the Triton kernels (`norm_triton`, `rope_triton`, `act_triton`);
- CPU: the native library where it has the op (fp32, bf16; `cpu_native`), or the Triton kernels
  in Triton's interpreter when the `triton` attention backend is forced (the step's backend, else
  `KSERVE_PAGED_ATTENTION_BACKEND`) under `TRITON_INTERPRET=1` (tests and the acceptance dry
  run) and the kernels were defined interpreted;
- otherwise nothing: None / False.
Importing this module imports no Triton; the kernel modules load on the first call that uses
them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from kserve_paged_kernels import cpu_native, settings

__all__ = ["act_mul", "add_rms_norm", "rope_store_", "triton_module"]


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_module(name: str, device: torch.device, backend: str | None = None
                  ) -> ModuleType | None:
    """`kernels.<name>` if its Triton kernels can run on `device` for this call, else None.

    CUDA: whenever Triton imports. CPU: only with the triton backend forced (`backend`, else
    the env setting), the interpreter on, and the module's kernels defined interpreted (a
    module imported compiled cannot run on CPU tensors)."""
    if device.type == "cpu":
        forced = (backend or settings.attention_backend() or "").strip().lower()
        if forced != "triton" or not _interpreter_on():
            return None
    elif device.type != "cuda":
        return None
    try:
        module = importlib.import_module(f"kserve_paged_kernels.{name}")
    except ImportError:
        return None
    if device.type == "cpu" and not any(type(v).__name__ == "InterpretedFunction"
                                        for v in vars(module).values()):
        return None
    return module


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, gemma: bool = False) -> torch.Tensor | None:
    """`norm(x + residual)` with `residual` updated in place to the sum, or `norm(x)` without
    one (Llama's `w * x`, or Gemma's `(1 + w) * x` with `gemma`); None when no fused kernel
    takes these tensors (`kserve_paged_kernels.reference.add_rms_norm_ref` defines the result)."""
    mod = triton_module("norm_triton", x.device)
    if mod is not None:
        if not mod.usable(x, residual, weight):
            return None
        return mod.add_rms_norm_triton(x, residual, weight, eps, gemma=gemma)
    if x.device.type == "cpu" and not gemma:
        return cpu_native.add_rms_norm(x, residual, weight, eps)
    return None


def rope_store_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                *, backend: str | None = None) -> bool:
    """RoPE in place on the q and k heads of fused qkv rows and, with a cache, the K/V store
    (slots < 0 skipped) in one kernel; False (nothing done) when no kernel does both here.
    `kserve_paged_kernels.reference.rope_ref` and `store_kv_ref` define the result. CPU's native library
    rotates but has no fused store, so there the caller keeps its own path. In place, so never
    under autograd."""
    if torch.is_grad_enabled() or not isinstance(kv_cache, torch.Tensor | None):
        return False  # a quantized cache (QuantKV): its store quantizes, the caller's path
    mod = triton_module("rope_triton", qkv.device, backend)
    if mod is None or not mod.usable(qkv, positions, cos, sin, num_heads, num_kv_heads,
                                     kv_cache, slot_mapping):
        return False
    mod.rope_store_triton(qkv, positions, cos, sin, num_heads, num_kv_heads, kv_cache,
                          slot_mapping)
    return True


def act_mul(gate_up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor | None:
    """`silu(gate) * up` (or tanh-GELU with `gelu`) of a fused `[rows, 2 * inter]` projection;
    None when no fused kernel takes it (`kserve_paged_kernels.reference.act_mul_ref` defines the result)."""
    mod = triton_module("act_triton", gate_up.device)
    if mod is not None:
        return mod.act_mul_triton(gate_up, gelu=gelu) if mod.usable(gate_up) else None
    if gate_up.device.type == "cpu":
        return cpu_native.gelu_mul(gate_up) if gelu else cpu_native.silu_mul(gate_up)
    return None
