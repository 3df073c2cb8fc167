"""Dynamic int8 activations x int8 weights (W8A8) on CPU.

Why: a W8A8 checkpoint (compressed-tensors `int-quantized` with dynamic `input_activations`)
was trained to run its activations through int8 too; on a CPU with VNNI (`vpdpbusd`) an int8
dot product does four multiply-adds per 32-bit lane where fp32 does one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

QMAX = 127.0  # symmetric int8: codes in [-127, 127], as vLLM's dynamic per-token quantization


def quantize_rows(x: torch.Tensor, per_token: bool = True, shifted: bool = False,
                  amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of a 2-D `x` and their float32 scale (`[rows, 1]` per token, `[1, 1]`
    per tensor): `scale = max |x| / 127`, `q = round(x / scale)`; an all-zero row gets scale 1.
    `shifted`: the codes plus 128 as uint8 (what oneDNN's u8 x s8 product reads), in one pass.
    `amax_reduce`: the max |x| taken over the other tensor-parallel ranks' columns too."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1, 1)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = (xf / scale).round_().clamp_(-QMAX, QMAX)
    return (q.add_(128).to(torch.uint8) if shifted else q.to(torch.int8)), scale


# The CPU flags that give int8 dot products (`vpdpbusd`), best first: AVX-512 VNNI (Ice Lake,
# Sapphire Rapids with AMX, Zen 4/5), then AVX-VNNI (Alder Lake, Zen 5's 256-bit form).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def vnni(flags: frozenset[str]) -> str | None:
    """The VNNI flag a CPU with `flags` has (the reason to run int8 activations), or None: there
    int8 x int8 has no instruction of its own, and W8A8 stays weight-only."""
    return next((f for f in VNNI_FLAGS if f in flags), None)


@dataclass(slots=True)
class W8A8Weight:
    """int8 codes with one float32 scale per output channel, multiplied with activations
    quantized to int8 at each call (per token or per tensor): `y = (qx qw^T) sx sw`, the int8
    products summed exactly in int32 by oneDNN (`onednn::qlinear_pointwise`, weights prepacked
    once; VNNI's `vpdpbusd` where the CPU has it). oneDNN multiplies unsigned by signed bytes,
    so the codes go in shifted by 128 with zero point 128, which it subtracts exactly."""

    packed: torch.Tensor  # onednn::qlinear_prepack of the int8 codes [out, in]
    scales: torch.Tensor  # float32 [out]
    zero_points: torch.Tensor  # int64 [out], zeros (symmetric weights), as oneDNN takes them
    out_features: int
    in_features: int
    per_token: bool  # activation scales: one per row (token), else one per call (tensor)
    kernel: str = "int8 x int8 (oneDNN qlinear)"
    # A row-parallel shard's: the activations' max over every rank's input columns (an
    # all-reduce), so each rank quantizes its columns with the whole row's scale, as TP 1 does.
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes


_ONE, _ZERO_POINT = torch.tensor(1.0), torch.tensor(128, dtype=torch.int64)


def available() -> bool:
    """Whether PyTorch's oneDNN int8 linear is built in (it is in the x86 CPU wheels)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


@functools.cache
def kernel_exact() -> bool:
    """Whether oneDNN's int8 product is exact on this process's CPU, asked of the kernel itself.

    Why not the flags alone: without VNNI oneDNN multiplies u8 by s8 with `vpmaddubsw`, whose
    16-bit sums would saturate, so it halves the weights it packs and the product is no longer
    the int8 one. Which instructions oneDNN uses is its own choice (the CPU, and
    `ONEDNN_MAX_CPU_ISA`), so the probe runs the kernel on the worst case for that path, the
    largest codes on both sides, and compares with the exact integer sums (below 2**24: exact
    in the float32 output)."""
    if not available():
        return False
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (16, 64), dtype=torch.int8, generator=g)
    codes[0], codes[1] = 127, -127
    x = torch.randint(-127, 128, (4, 64), generator=g).float()
    x[0] = 127.0
    weight = pack_w8a8(codes, torch.ones(16), per_token=False)
    got = torch.ops.onednn.qlinear_pointwise.tensor(
        (x + 128).to(torch.uint8), _ONE, _ZERO_POINT, weight.packed, weight.scales,
        weight.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
    return torch.equal(got, x @ codes.float().t())


def pack_w8a8(codes: torch.Tensor, scales: torch.Tensor, per_token: bool) -> W8A8Weight:
    """int8 codes `[out, in]` and per-channel scales (`[out]` or `[out, 1]`) as a W8A8 weight."""
    out_f, in_f = codes.shape
    if codes.dtype != torch.int8 or scales.numel() != out_f:
        raise ValueError(f"W8A8 needs int8 codes and one scale per output channel "
                         f"(codes {codes.dtype} {list(codes.shape)}, {scales.numel()} scales)")
    packed = torch.ops.onednn.qlinear_prepack(codes.contiguous(), None)
    return W8A8Weight(packed, scales.float().reshape(out_f).contiguous(),
                      torch.zeros(out_f, dtype=torch.int64), out_f, in_f, per_token)


def w8a8_mm(x: torch.Tensor, weight: W8A8Weight) -> torch.Tensor:
    """`x @ w.T` for 2-D `x` `[rows, in]`, `x` quantized as `quantize_rows`; float32 out."""
    q8, sx = quantize_rows(x, weight.per_token, shifted=True, amax_reduce=weight.amax_reduce)
    out = torch.ops.onednn.qlinear_pointwise.tensor(
        q8, _ONE, _ZERO_POINT, weight.packed, weight.scales, weight.zero_points, None, 1.0, 0,
        torch.float32, "none", [], "")
    return out.mul_(sx)


def dequant_w8a8(weight: W8A8Weight) -> torch.Tensor:
    """The float32 weight `[out, in]` the codes stand for, read back through the kernel: a row
    of the identity quantizes exactly (code 127, scale 1/127), so this is `q s` to fp32
    rounding (for tests and logs; the codes are not kept beside the packed copy)."""
    return w8a8_mm(torch.eye(weight.in_features), weight).t().contiguous()
