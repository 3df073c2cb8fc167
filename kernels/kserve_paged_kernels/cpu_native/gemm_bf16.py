"""The bf16 matrix product of the linear layers, over weights packed once into bf16 pairs.

`csrc/gemm_bf16.c` multiplies bf16 rows by a weight packed into column panels of
`gemm_panel()` outputs, each 32-bit lane a pair of consecutive input dims of one output (the
operand layout of `vdpbf16ps`, which the avx512_bf16 and amx levels use; the others widen the
pair exactly to two fp32 values). Sums are fp32 and each output is rounded to bf16 once, as
F.linear in bf16 does, so the two differ in summation order only.
"""

from __future__ import annotations

import torch

from kserve_paged_kernels.cpu_native.huge_pages import on_huge_pages
from kserve_paged_kernels.cpu_native.loader import gemm_panel, load, loaded_level, sync_threads
from kserve_paged_kernels.cpu_native.ops import rows_of


def pack_gemm_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` bf16 weight (K even) -> int32 `[ceil(N / P), K / 2, P]`: lane j of row k2 of
    panel p holds dims 2 k2 (low half) and 2 k2 + 1 of output p P + j; zero past N."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        raise ValueError("pack_gemm_weight_bf16 takes a 2-D bfloat16 weight with even columns")
    panel = gemm_panel()
    if not panel:
        raise RuntimeError("the native CPU kernels are not loaded (check gemm_available())")
    n, k = weight.shape
    panels = -(-n // panel)
    padded = torch.zeros((panels * panel, k), dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    pairs = padded.view(panels, panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return on_huge_pages(pairs.view(torch.int32).view(panels, k // 2, panel))


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T (+ bias)` in bf16 with a weight from `pack_gemm_weight_bf16`; None when
    `x` or `bias` is not in the kernel's layout (bf16 rows with unit stride), so the caller
    falls back."""
    lib = load()
    if (lib is None or not rows_of(x, torch.bfloat16) or packed.dim() != 3
            or packed.dtype != torch.int32 or x.shape[1] != 2 * packed.shape[1]
            or packed.shape[2] != gemm_panel() or packed.shape[0] * packed.shape[2] < out_features
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.numel() != out_features))):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    sync_threads(lib)
    rc = lib.kp_gemm_bf16(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), x.shape[1],
                          out_features, bias.data_ptr() if bias is not None else None,
                          out.data_ptr(), out_features)
    return out if rc == 0 else None


def native_bf16_linear() -> bool:
    """Whether bf16 `Linear` layers take `gemm_bf16` instead of oneDNN's pre-packed bf16
    weight: where the loaded level multiplies bf16 pairs with `vdpbf16ps` and has no AMX
    (avx512_bf16): measured there 1.1-1.8x oneDNN at 1-64 rows and level at 256 (BENCHMARKS.md,
    "a native bf16 GEMM"). Not yet measured against oneDNN's AMX kernels (amx) or its emulated
    bf16 (avx512): those keep oneDNN."""
    level = loaded_level()
    return level is not None and level.name == "avx512_bf16"
