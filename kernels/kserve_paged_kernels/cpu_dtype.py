"""What `--dtype auto` means on CPU: a pure function of the CPU's flags.

Our rule, not vLLM's (vLLM-CPU's `auto` takes the checkpoint's dtype): bfloat16 where the CPU
computes in it natively (AVX512-BF16 dot products, or AMX tiles), float32 where bfloat16 would
be emulated (AVX2, and AVX-512 without BF16, e.g. Ice Lake). Emulated bfloat16 widens every
operand to fp32 and rounds every result back, so it costs more than fp32 itself (issue 30: 0.73x
and 0.86x of vLLM-CPU's emulated bf16 on Ice Lake, against 1.51x and 1.28x in fp32), while
native bfloat16 halves the bytes that weights and the KV cache move. The engine's
`resolve_dtype` (engine/kserve_paged_engine/core/kv_sizing.py) calls this for `auto` on CPU; CUDA's `auto` stays the
checkpoint's dtype there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Any one of these /proc/cpuinfo flags means bfloat16 arithmetic in hardware.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16(flags: Iterable[str]) -> bool:
    """True when the CPU with these flags multiplies bfloat16 natively."""
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


def cpu_auto_dtype(flags: Iterable[str]) -> torch.dtype:
    """`--dtype auto` on a CPU with these flags: bfloat16 if native, else float32."""
    return torch.bfloat16 if native_bf16(flags) else torch.float32


def describe(flags: Iterable[str]) -> str:
    """Why `auto` chose what it chose on a CPU with these flags, for the start-up log."""
    flags = frozenset(flags)
    found = sorted(NATIVE_BF16_FLAGS & flags)
    if found:
        return f"native bf16 on this CPU: {', '.join(found)}"
    return ("no avx512_bf16 or amx_bf16 on this CPU: bfloat16 would be emulated, slower than "
            "float32")


def kernels_taken(dtype: torch.dtype) -> str:
    """The CPU kernels a model in `dtype` runs (projections; attention), for the start-up log."""
    from kserve_paged_kernels import settings
    from kserve_paged_kernels.cpu_native import gemm_available, isa, loader, native_bf16_linear
    from kserve_paged_kernels.cpu_native.ops import TILE_HEAD_DIMS

    lib = loader.load()
    level = isa.current()
    native = f"native library at level {level.name}" if lib is not None and level else (
        "no native library")
    if dtype == torch.float32:
        proj = "native GEMM over packed weights" if gemm_available() else "oneDNN fp32"
        attn = "native paged attention (fp32 KV)" if lib is not None else "SDPA"
    elif dtype == torch.bfloat16:
        if not settings.onednn_enabled():
            proj = "F.linear in bf16 (KSERVE_PAGED_ONEDNN=0)"
        elif native_bf16_linear():
            proj = "native bf16 GEMM over pair-packed weights (vdpbf16ps)"
        elif torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            proj = "oneDNN bf16 over pre-packed weights (AMX where present)"
        elif gemm_available():
            proj = "bf16 weights widened once to fp32, native GEMM (no oneDNN bf16 here)"
        else:
            proj = "F.linear in bf16"
        dot = "vdpbf16ps" if level and isa.bf16_dot(level) else "exact widening + FMA"
        dims = " and ".join(map(str, TILE_HEAD_DIMS))
        attn = (f"native paged attention over the bf16 KV cache (fp32 softmax and sums; q.k by "
                f"{dot}; prefill tiles for head dims {dims})" if lib is not None
                else "SDPA in bf16")
    else:
        proj, attn = "F.linear", "SDPA"
    return f"{native}; projections: {proj}; attention: {attn}"
