"""The fp32 matrix products of the linear layers, over weights packed once into panels.

`csrc/gemm.c` (AVX-512 only: `gemm_available()` says whether it is compiled in) multiplies by a
weight packed into column panels of GEMM_PANEL outputs; `gemm_silu` is the SwiGLU MLP's first
half with the SiLU-and-multiply done inside the product. The convention for "cannot run here"
is the package's (kernels/cpu_native/__init__.py).
"""

from __future__ import annotations

import torch

from kernels.cpu_native.loader import load, sync_threads
from kernels.cpu_native.ops import f32_rows

GEMM_PANEL = 48  # output columns per packed panel (KP_GEMM_PANEL in csrc/kp_native.h)


def gemm_available() -> bool:
    """True when the library is loaded and was built with AVX-512 (the GEMM's only version)."""
    lib = load()
    return lib is not None and bool(lib.kp_gemm_available())


def prefill_tiles() -> bool:
    """True when the library has its AVX-512 prefill paths (transposed-key tiles, the same
    compile switch as the GEMM). Without them the row kernel walks one query row at a time and
    SDPA is several times faster for prefill (BENCHMARKS.md), so kernels/cpu_backend.py hands
    the row kernel only the decode rows there."""
    return gemm_available()


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` fp32 weight -> `[ceil(N / 48), K, 48]` column panels, zero-padded past N."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError("pack_gemm_weight takes a 2-D float32 weight")
    n, k = weight.shape
    panels = -(-n // GEMM_PANEL)
    padded = torch.zeros((panels * GEMM_PANEL, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, GEMM_PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
         bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T (+ bias)` with a weight from `pack_gemm_weight`; None when `x` or `bias`
    is not in the kernel's layout (fp32, rows with unit stride), so the caller falls back."""
    lib = load()
    if (lib is None or not f32_rows(x) or x.shape[1] != packed.shape[1]
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    sync_threads(lib)
    rc = lib.kp_gemm_f32(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), x.shape[1],
                         out_features, bias.data_ptr() if bias is not None else None,
                         out.data_ptr(), out_features)
    if rc != 0:
        return None
    return out



def _gate_up_pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows of gate and up, each zero-padded to whole panels, interleaved panel by panel."""
    rest = gate.shape[1:]
    pairs = -(-gate.shape[0] // GEMM_PANEL)
    pad = torch.zeros((pairs * GEMM_PANEL - gate.shape[0], *rest), dtype=torch.float32)
    halves = [torch.cat([h.detach().float(), pad]).view(pairs, GEMM_PANEL, *rest)
              for h in (gate, up)]
    return torch.stack(halves, dim=1).reshape(pairs * 2 * GEMM_PANEL, *rest)


def pack_gate_up_weight(weight: torch.Tensor) -> torch.Tensor:
    """A fused `[2 * inter, K]` gate/up weight -> panels for `gemm_silu`: gate and up outputs
    48 at a time, pair by pair (each half zero-padded to whole panels)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % 2:
        raise ValueError("pack_gate_up_weight takes a 2-D float32 [2 * inter, K] weight")
    inter = weight.shape[0] // 2
    return pack_gemm_weight(_gate_up_pairs(weight[:inter], weight[inter:]))


def pack_gate_up_bias(bias: torch.Tensor) -> torch.Tensor:
    """The fused gate/up bias in the order of `pack_gate_up_weight`'s outputs."""
    if bias.dim() != 1 or bias.shape[0] % 2:
        raise ValueError("pack_gate_up_bias takes a [2 * inter] bias")
    inter = bias.shape[0] // 2
    return _gate_up_pairs(bias[:inter], bias[inter:])


def gemm_silu(x: torch.Tensor, packed: torch.Tensor, inter: int,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`silu(x @ gate.T + bg) * (x @ up.T + bu)` `[rows, inter]` with a weight (and bias) from
    `pack_gate_up_weight` / `pack_gate_up_bias`; None when `x` is not in the kernel's layout.
    (A plain `pack_gemm_weight` of the fused weight has the same shape when inter is a multiple
    of 48, but not the pair order: only pass what `pack_gate_up_weight` made.)"""
    lib = load()
    pairs = -(-inter // GEMM_PANEL)
    if (lib is None or not f32_rows(x) or packed.dim() != 3 or x.shape[1] != packed.shape[1]
            or packed.shape[0] != 2 * pairs or packed.shape[2] != GEMM_PANEL
            or packed.dtype != torch.float32 or not packed.is_contiguous()
            or packed.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                      or bias.numel() != 2 * pairs * GEMM_PANEL))):
        return None
    rows = x.shape[0]
    scratch = torch.empty((rows, 2 * pairs * GEMM_PANEL), dtype=torch.float32)
    out = torch.empty((rows, inter), dtype=torch.float32)
    sync_threads(lib)
    rc = lib.kp_gemm_silu_f32(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), x.shape[1],
                              inter, bias.data_ptr() if bias is not None else None,
                              scratch.data_ptr(), scratch.stride(0), out.data_ptr(), inter)
    return out if rc == 0 else None
