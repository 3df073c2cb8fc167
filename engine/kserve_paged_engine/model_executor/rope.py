"""Rotary position embedding: a config's RoPE settings read into one dict, the inverse
frequencies of every scaling transformers knows (default, linear, llama3, dynamic, yarn,
longrope), and the layer that rotates queries and keys over flat token batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kserve_paged_kernels import cpu_native

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


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
