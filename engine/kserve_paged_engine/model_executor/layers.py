"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, SwiGLU MLP.

They work on flat token batches (`[num_tokens, ...]`, all sequences concatenated), the shape the
paged engine schedules, rather than transformers' padded `[batch, seq, ...]`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_kernels import cpu_native, fused_ops, quant_linear, settings

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


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
            self._packed, self._native = cpu_native.pack_gemm_weight(w), True
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


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of a config as one dict with `rope_type` and `rope_theta`.

    transformers 5.x keeps them in `config.rope_parameters` (per layer type for Gemma 3:
    `{"full_attention": {...}, "sliding_attention": {...}}`, picked by `layer_type`); older
    configs have `rope_theta` plus an optional `rope_scaling` dict (whose type key may be `type`
    or `rope_type`), and Gemma 3's local layers `rope_local_base_freq`.
    """
    params: dict[str, Any] = {}
    new = getattr(config, "rope_parameters", None)
    old = getattr(config, "rope_scaling", None)
    if isinstance(new, Mapping) and new:
        params.update(new)
    elif isinstance(old, Mapping) and old:
        params.update(old)
    if any(isinstance(v, Mapping) for v in params.values()):
        if layer_type is None or not isinstance(params.get(layer_type), Mapping):
            raise ValueError(f"per-layer-type RoPE parameters {sorted(params)} need a layer type "
                             f"this model has (got {layer_type!r})")
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn", "longrope", "dynamic"):
        original = (getattr(config, "original_max_position_embeddings", None)
                    or config.max_position_embeddings)
        params.setdefault("original_max_position_embeddings", original)
    if params["rope_type"] in ("longrope", "yarn") and params.get("factor") is None:
        # Phi-3 and DeepSeek leave the factor out: it is the context's stretch.
        params["factor"] = (config.max_position_embeddings
                            / params["original_max_position_embeddings"])
    return params


def rope_max_positions(max_position_embeddings: int, params: Mapping[str, Any]) -> int:
    """Positions the model can take: yarn and dynamic stretch the original context by `factor`
    (as vLLM derives the length limit), the other types stop at `max_position_embeddings`."""
    if params["rope_type"] in ("yarn", "dynamic"):
        stretched = int(params["original_max_position_embeddings"] * float(params["factor"]))
        return max(max_position_embeddings, stretched)
    return max_position_embeddings


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_factor(params: Mapping[str, Any]) -> float:
    """The factor yarn and longrope multiply cos and sin by (1 for the other types)."""
    rope_type = params["rope_type"]
    given = params.get("attention_factor")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = float(params["factor"])
    if rope_type == "yarn":
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))


def _inv_freq(head_dim: int, params: Mapping[str, Any], *, long: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, `[head_dim // 2]`) after the rope type's scaling.
    `long`: longrope's set for positions past the original context (else its short set)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by this engine")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope_type == "dynamic":
        # NTK-aware base for the whole stretched context, fixed (vLLM's form): transformers
        # re-derives it from each forward's length, which a cache shared across steps cannot.
        factor = float(params["factor"])
        base = base * (factor * factor - factor + 1) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "longrope":
        ext = params["long_factor" if long else "short_factor"]
        if len(ext) != head_dim // 2:
            raise ValueError(f"longrope factors need {head_dim // 2} entries, got {len(ext)}")
        inv_freq = inv_freq / torch.tensor(ext, dtype=torch.float32)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, base, params)
    elif rope_type == "llama3":
        # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float,
                   params: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, and ramp
    linearly between the dimensions that turn `beta_slow` and `beta_fast` times over the
    original context."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as is), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) from a cos/sin table built once.

    The table holds `[max_positions, head_dim // 2]` angles' cos and sin, computed in float32
    and stored in the module's dtype (as transformers casts them), so a step only gathers rows.
    """

    def __init__(self, head_dim: int, max_positions: int, params: Mapping[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.params = dict(params)
        _inv_freq(head_dim, self.params)  # validate early, even when built on the meta device
        cos, sin = self._table(torch.get_default_device())
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device.type == "meta":
            shape = (self.max_positions, self.head_dim // 2)
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        pos = torch.arange(self.max_positions, dtype=torch.int64).float()
        angles = torch.outer(pos, _inv_freq(self.head_dim, self.params))
        if self.params["rope_type"] == "longrope":
            # Short factors inside the original context, long ones past it, per position, so a
            # token's rotation never depends on how long its sequence later grows (transformers
            # picks one set per forward from its longest position).
            old_len = int(self.params["original_max_position_embeddings"])
            long = torch.outer(pos[old_len:], _inv_freq(self.head_dim, self.params, long=True))
            angles[old_len:] = long
        scale = _attention_factor(self.params)
        return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)

    def rebuild(self) -> None:
        """Recompute the table in place (after `to_empty()` left it uninitialised)."""
        cos, sin = self._table(self.cos.device)
        self.cos = cos.to(self.cos.dtype)
        self.sin = sin.to(self.sin.dtype)

    def rotate_fused_(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> bool:
        """Rotate, in place, the first `heads` heads (q then k) of fused qkv rows `[T, ...]`.

        Native CPU path only; False (nothing done) when it does not apply, then use forward.
        """
        if torch.is_grad_enabled():
            return False
        return cpu_native.rope_inplace(qkv, positions, self.cos, self.sin, heads,
                                       self.head_dim) is not None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` by their tokens' positions `[T]`."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equals x*cat(cos,cos) + rotate_half(x)*cat(sin,sin) elementwise, without the doubled table.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
