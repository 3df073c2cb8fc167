"""Building blocks of Llama-family decoders: linear layers, RMSNorm, SwiGLU MLP (the rotary
embedding: rope.py).

They work on flat token batches (`[num_tokens, ...]`, all sequences concatenated), the shape the
paged engine schedules, rather than transformers' padded `[batch, seq, ...]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_kernels import cpu_native, fused_ops, quant_linear, settings


class Linear(nn.Linear):
    """`nn.Linear` that, once `pack()`ed on CPU, multiplies with a pre-packed weight.

    Why: a serving step multiplies 1-128 rows (decode) or a few thousand (prefill) by weights
    that are read from memory every step. On CPU in float32, `pack()` lays the weight out in
    column panels for the native GEMM (`kernels/kserve_paged_kernels/csrc/gemm.c`, every instruction-set level),
    faster than oneDNN at decode row counts (bench/probes/gemm_levels.py, figures in
    BENCHMARKS.md). In bfloat16, oneDNN's packed bf16 weight (AMX where the CPU has it); where
    torch refuses oneDNN bf16 (AVX2-only CPUs), the weight widened once to fp32 panels for the
    native GEMM. Without the native library in fp32, oneDNN's packed weight. All faster than
    torch's default path at serving shapes.
    The packed copy is extra memory (one more copy of the weight); any change to `weight`
    after packing needs a new `pack()`. `KSERVE_PAGED_ONEDNN=0`: no packing, plain `F.linear`
    (`KSERVE_PAGED_NATIVE=0` alone leaves oneDNN).
    """

    _packed: torch.Tensor | None = None
    quant: quant_linear.QuantWeight | None = None  # set by `quantize`: weight-only quantized
    _native: bool = False
    _widened: bool = False  # bf16 weight packed as fp32 for the native GEMM (no oneDNN bf16)
    _bf16_native: bool = False  # bf16 weight packed in bf16 pairs for the native bf16 GEMM
    _bias32: torch.Tensor | None = None
    # The owner replaces the native fp32 pack with one of its own (SwiGLUMLP.pack fuses gate and
    # up): that pack is only a step, kept off the huge-page arena, which never reuses space.
    fused_by_owner: bool = False

    def pack(self, rows_hint: int = 64) -> bool:
        """Pre-pack for inference (CPU, float32 or bfloat16); True if packed."""
        w = self.weight
        self._packed, self._native, self._widened, self._bias32 = None, False, False, None
        self._bf16_native = False
        if self.quant is not None:
            return False
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not settings.onednn_enabled()):
            return False
        if w.dtype == torch.float32 and cpu_native.gemm_available():
            self._packed = cpu_native.pack_gemm_weight(w, huge_pages=not self.fused_by_owner)
            self._native = True
            return True
        if (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0
                and cpu_native.native_bf16_linear()):
            # Our vdpbf16ps GEMM over bf16 pairs, where measured faster than oneDNN (its doc).
            self._packed, self._bf16_native = cpu_native.pack_gemm_weight_bf16(w), True
            return True
        if w.dtype == torch.bfloat16 and not onednn_bf16():
            # oneDNN packs bf16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT. On the
            # others (AVX2) the weight is widened once to fp32 panels for the native GEMM:
            # 4-5x torch's own bf16 matmul at 16-256 rows (BENCHMARKS.md, "bfloat16 on CPU");
            # a single row still takes F.linear.
            if not cpu_native.gemm_available():
                return False
            self._packed, self._widened = cpu_native.pack_gemm_weight(w.float()), True
            self._bias32 = None if self.bias is None else self.bias.detach().float()
            return True
        if not torch.backends.mkldnn.is_available():
            return False
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
        return True

    def quantize(self, weight: quant_linear.QuantWeight) -> None:
        """Multiply with `weight` from now on and free the float weight (its dtype and device
        stay, on an empty tensor)."""
        if (weight.out_features, weight.in_features) != tuple(self.weight.shape):
            raise ValueError(f"a [{weight.out_features}, {weight.in_features}] quantized weight "
                             f"for a {list(self.weight.shape)} projection")
        self.quant, self._packed, self._native = weight, None, False
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_linear.matmul(x, self.quant, self.bias)
        packed = self._packed
        if packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype and not (
                torch.is_grad_enabled() and self.weight.requires_grad):
            if self._bf16_native:
                out = cpu_native.gemm_bf16(x, packed, self.out_features, self.bias)
                if out is not None:
                    return out
            elif self._widened:
                # One row reads the bf16 weight faster through torch (half the bytes): 0.6x
                # for the widened GEMM there, 4-5x from 16 rows on (BENCHMARKS.md).
                out = None if x.shape[0] <= 1 else cpu_native.gemm(
                    x.float(), packed, self.out_features, self._bias32)
                if out is not None:
                    return out.to(x.dtype)
            elif not self._native:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            else:
                out = cpu_native.gemm(x, packed, self.out_features, self.bias)
                if out is not None:
                    return out
        return F.linear(x, self.weight, self.bias)


def onednn_bf16() -> bool:
    """Whether torch's oneDNN takes bf16 linear layers on this CPU (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; torch refuses it on AVX2-only CPUs)."""
    return (torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class RMSNorm(nn.Module):
    """Root-mean-square norm, optionally fused with the residual add that precedes it.

    The variance is taken in float32 and the normalised value cast back before the weight
    multiply, as transformers does, so float32 and bfloat16 results match it bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
        if x.dim() == 2 and not torch.is_grad_enabled():
            # One fused pass (native on CPU fp32, Triton on CUDA). The residual is updated in
            # place: the model's first residual is the embedding output, which nothing else holds.
            fused = fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused if residual is None else (fused, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def native_weight(self) -> torch.Tensor | None:
        """What the native kernels multiply the normalised row by (None: not this norm)."""
        return self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one `[2*I, H]` matmul.

    One larger GEMM reads x once. Once `pack()`ed natively, gate and up are interleaved panel by
    panel and the activation-and-multiply happens inside that GEMM (`cpu_native.gemm_silu`, or
    `gemm_gelu` for GeGLU), on the core that computed both halves; no second packed copy."""

    _fused: torch.Tensor | None = None
    _fused_bias: torch.Tensor | None = None
    gelu = False  # tanh-GELU for SiLU: GeGLU (a subclass sets it: models/gemma.py)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.gate_up_proj.fused_by_owner = True
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def pack(self) -> bool:
        """Interleave gate/up for `gemm_silu` (`gemm_gelu`) when the gate/up projection is on
        the native GEMM (call after its `pack()`); True if done."""
        proj = self.gate_up_proj
        self._fused = self._fused_bias = None
        if not proj._native:
            return False
        self._fused = cpu_native.pack_gate_up_weight(proj.weight.detach())
        if proj.bias is not None:
            self._fused_bias = cpu_native.pack_gate_up_bias(proj.bias.detach())
        proj._packed, proj._native = None, False  # one packed copy is enough
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and x.dim() == 2 and not torch.is_grad_enabled():
            act = (cpu_native.gemm_gelu if self.gelu else cpu_native.gemm_silu)(
                x, self._fused, self.intermediate_size, self._fused_bias)
            if act is not None:
                return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        if gate_up.dim() == 2 and not torch.is_grad_enabled():
            fused = fused_ops.act_mul(gate_up, gelu=self.gelu)
            if fused is not None:
                return self.down_proj(fused)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)
