"""The fp32 matrix products of the linear layers, over weights packed once into panels.

`csrc/gemm.c` multiplies by a weight packed into column panels of `gemm_panel()` outputs (the
loaded level's width, which loader.py asks the library: 48 with AVX-512, 16 with AVX2;
`KP_GEMM_PANEL` in csrc/kp_native.h);
`gemm_silu` is the SwiGLU MLP's first half with the SiLU-and-multiply done inside the product,
`gemm_gelu` the same for GeGLU (tanh-GELU).
A packed weight fits the library it was packed for, so packing asks the loaded library. The
convention for "cannot run here" is the package's (kernels/kserve_paged_kernels/cpu_native/__init__.py).
"""

from __future__ import annotations

import torch

from kserve_paged_kernels.cpu_native.huge_pages import on_huge_pages
from kserve_paged_kernels.cpu_native.loader import gemm_panel, load, sync_threads
from kserve_paged_kernels.cpu_native.ops import f32_rows


def gemm_available() -> bool:
    """True when the library is loaded: the GEMM, the decoder stack and the prefill tiles are
    in every level's build (csrc/kp_vec.h)."""
    return gemm_panel() > 0


def prefill_tiles() -> bool:
    """True when prefill rows should go to the native kernel (its transposed-key tiles: faster
    than SDPA, BENCHMARKS.md); False without the library, so kernels/kserve_paged_kernels/cpu_backend.py can be
    tested both ways by replacing this function."""
    return gemm_available()


def _panel_or_raise() -> int:
    panel = gemm_panel()
    if not panel:
        raise RuntimeError("the native CPU kernels are not loaded (check gemm_available())")
    return panel


def pack_gemm_weight(weight: torch.Tensor, huge_pages: bool = True) -> torch.Tensor:
    """`[N, K]` fp32 weight -> `[ceil(N / P), K, P]` column panels (P = `gemm_panel()`),
    zero-padded past N. `huge_pages`: in the huge-page arena (huge_pages.py), which never
    reuses space, so a pack that is only a step toward another (stacked, fused) says False."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError("pack_gemm_weight takes a 2-D float32 weight")
    panel = _panel_or_raise()
    n, k = weight.shape
    panels = -(-n // panel)
    padded = torch.zeros((panels * panel, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    packed = padded.view(panels, panel, k).transpose(1, 2)
    return on_huge_pages(packed) if huge_pages else packed.contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
         bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T (+ bias)` with a weight from `pack_gemm_weight`; None when `x` or `bias`
    is not in the kernel's layout (fp32, rows with unit stride), so the caller falls back."""
    lib = load()
    if (lib is None or not f32_rows(x) or packed.dim() != 3 or x.shape[1] != packed.shape[1]
            or packed.shape[2] != gemm_panel() or packed.shape[0] * packed.shape[2] < out_features
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
    panel = _panel_or_raise()
    rest = gate.shape[1:]
    pairs = -(-gate.shape[0] // panel)
    pad = torch.zeros((pairs * panel - gate.shape[0], *rest), dtype=torch.float32)
    halves = [torch.cat([h.detach().float(), pad]).view(pairs, panel, *rest)
              for h in (gate, up)]
    return torch.stack(halves, dim=1).reshape(pairs * 2 * panel, *rest)


def pack_gate_up_weight(weight: torch.Tensor, huge_pages: bool = True) -> torch.Tensor:
    """A fused `[2 * inter, K]` gate/up weight -> panels for `gemm_silu`: gate and up outputs
    one panel at a time, pair by pair (each half zero-padded to whole panels).
    `huge_pages` as for `pack_gemm_weight`."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % 2:
        raise ValueError("pack_gate_up_weight takes a 2-D float32 [2 * inter, K] weight")
    inter = weight.shape[0] // 2
    return pack_gemm_weight(_gate_up_pairs(weight[:inter], weight[inter:]), huge_pages)


def unpack_gemm_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_gemm_weight`'s inverse: the `[out_features, K]` weight, a new tensor."""
    panels, k, panel = packed.shape
    return packed.transpose(1, 2).reshape(panels * panel, k)[:out_features].clone()


def unpack_gate_up_weight(packed: torch.Tensor, inter: int) -> torch.Tensor:
    """`pack_gate_up_weight`'s inverse: the fused `[2 * inter, K]` weight (gate rows, then up)."""
    twice, k, panel = packed.shape
    halves = packed.view(twice // 2, 2, k, panel).transpose(2, 3)  # [pairs, gate/up, P, K]
    return torch.cat([halves[:, h].reshape(-1, k)[:inter] for h in (0, 1)])


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
    of the panel, but not the pair order: only pass what `pack_gate_up_weight` made.)"""
    return _gemm_act("kp_gemm_silu_f32", x, packed, inter, bias)


def gemm_gelu(x: torch.Tensor, packed: torch.Tensor, inter: int,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`gemm_silu` with tanh-GELU for SiLU (GeGLU, Gemma's MLP): `gelu_tanh(x @ gate.T + bg) *
    (x @ up.T + bu)`, the GELU inside the GEMM (csrc/gemm.c), not a pass of its own."""
    return _gemm_act("kp_gemm_gelu_f32", x, packed, inter, bias)


def _gemm_act(entry: str, x: torch.Tensor, packed: torch.Tensor, inter: int,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    lib = load()
    if lib is None:
        return None
    panel = gemm_panel()
    pairs = -(-inter // panel)
    if (not f32_rows(x) or packed.dim() != 3 or x.shape[1] != packed.shape[1]
            or packed.shape[0] != 2 * pairs or packed.shape[2] != panel
            or packed.dtype != torch.float32 or not packed.is_contiguous()
            or packed.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                      or bias.numel() != 2 * pairs * panel))):
        return None
    rows = x.shape[0]
    scratch = torch.empty((rows, 2 * pairs * panel), dtype=torch.float32)
    out = torch.empty((rows, inter), dtype=torch.float32)
    sync_threads(lib)
    rc = getattr(lib, entry)(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), x.shape[1],
                             inter, bias.data_ptr() if bias is not None else None,
                             scratch.data_ptr(), scratch.stride(0), out.data_ptr(), inter)
    return out if rc == 0 else None
