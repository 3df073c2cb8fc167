"""Reading a PEFT LoRA adapter into per-projection (A, B) pairs laid out for the fused model.

The engine fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; PEFT keeps one (A, B)
per unfused projection. Each fused projection gets one `A` (the targeted shards' A stacked along
the rank) and one `B` of the fused output width, zero outside each shard's rows, so the delta of
every shard is one shrink and one expand: `(x @ A.T) @ B.T`. The scale (alpha / r, or
alpha / sqrt(r) with rsLoRA) is folded into B at load time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kserve_paged_engine.lora.digest import content_digest
from kserve_paged_engine.lora.folder import AdapterFolder
from kserve_paged_engine.lora.safe_read import (
    DTYPE_BYTES,
    MAX_HEADER_BYTES,
    read_config,
    read_safetensors,
)
from kserve_paged_engine.lora.tp_cut import cut_for_rank, full_shape

# PEFT's target name -> (our fused module, shard).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(slots=True)
class LoRAWeights:
    a: torch.Tensor  # [total rank, in_features]
    b: torch.Tensor  # [out_features, total rank], scaled


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int
    # (layer index, fused module path inside the layer) -> weights.
    weights: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)
    digest: str = ""  # of the files' content (digest.py): what keys its blocks
    # Under tensor parallelism: (config, tensors) as read, which rank 0 sends the other ranks
    # so each cuts its own share from the same content (worker/tp_lora.py).
    source: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def _read_config(source: AdapterFolder) -> dict[str, Any]:
    folder = Path(source.path)
    try:
        cfg = read_config(folder, source.fd)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {folder}: {exc}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)]
    unsupported += [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save")
                    if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise ValueError(f"LoRA adapter {folder}: unsupported option(s) {unsupported}")
    return cfg


def _shard_rows(model: Any, module: str, shard: str | None, out_features: int) -> tuple[int, int]:
    if shard is None:
        return 0, out_features
    if module.endswith("qkv_proj"):
        q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
    inter = out_features // 2
    return (0, inter) if shard == "gate" else (inter, inter)


def _sharded(model: Any) -> bool:
    return getattr(model, "tp", None) is not None


def _target_shape(model: Any, target: str) -> tuple[int, int]:
    """(in_features, out_features) PEFT saved for `target`: the unsharded projection's."""
    if _sharded(model):
        return full_shape(model, target)
    module, shard = TARGETS[target]
    linear = model.model.layers[0].get_submodule(module)
    return linear.in_features, _shard_rows(model, module, shard, linear.out_features)[1]


def max_adapter_bytes(model: Any, max_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of ``model`` can need: every
    supported projection of every layer at ``max_rank``, in float32, plus a header."""
    per_layer = sum(sum(_target_shape(model, target)) for target in TARGETS)
    return model.num_layers * max_rank * per_layer * max(DTYPE_BYTES.values()) + MAX_HEADER_BYTES


def open_folder(name: str, path: str | Path, roots: Sequence[str] | None = None
                ) -> AdapterFolder:
    """The adapter's folder, opened once (folder.py), confined to ``roots`` if given;
    ValueError naming the adapter."""
    try:
        return AdapterFolder(str(path), roots)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc}") from None


def load_adapter(name: str, path: str | Path | AdapterFolder, model: Any,
                 max_rank: int) -> LoRAAdapter:
    """Load and check an adapter for `model` (a LlamaForCausalLM); ValueError says what is
    wrong. Only safetensors weights are read (never a pickle), no larger than any adapter of
    this model at ``max_rank`` could be (engine/kserve_paged_engine/lora/safe_read.py). Given
    an open AdapterFolder, its files are read through it (after its check); given a path, the
    folder is opened for this one read."""
    if isinstance(path, AdapterFolder):
        try:
            path.check()
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        return _load(name, path, model, max_rank)
    source = open_folder(name, path)
    try:
        return _load(name, source, model, max_rank)
    finally:
        source.close()


def _load(name: str, source: AdapterFolder, model: Any, max_rank: int) -> LoRAAdapter:
    folder = Path(source.path)
    cfg = _read_config(source)
    r = int(cfg.get("r", 8))
    if not 1 <= r <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {r} exceeds max_lora_rank {max_rank}")
    weights_file = folder / "adapter_model.safetensors"
    if not source.has(weights_file.name) and source.has("adapter_model.bin"):
        raise ValueError(f"LoRA adapter {name!r}: only adapter_model.safetensors is read; "
                         "adapter_model.bin (a pickle) never is: convert it to safetensors")
    try:
        tensors = read_safetensors(weights_file, max_adapter_bytes(model, max_rank), source.fd)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc} in {folder}") from None
    adapter = build_adapter(name, cfg, tensors, model, max_rank, str(weights_file))
    if _sharded(model):
        adapter.source = (cfg, tensors)
    return adapter


def build_adapter(name: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], model: Any,
                  max_rank: int, where: str = "adapter_model.safetensors") -> LoRAAdapter:
    """The adapter of config `cfg` and `tensors` (as read, checked here against the model's
    unsharded shapes) laid out for `model`: this rank's cut of it under tensor
    parallelism (tp_cut.py)."""
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if not 1 <= r <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {r} exceeds max_lora_rank {max_rank}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets a module the engine "
                             f"does not adapt (supported: {', '.join(TARGETS)})")
        layer = int(m.group(1))
        if layer >= model.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} beyond the model's "
                             f"{model.num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = tensor
    layers = model.model.layers
    param = next(model.parameters())
    grouped: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        module, shard = TARGETS[target]
        linear = layers[layer].get_submodule(module)
        start, size = _shard_rows(model, module, shard, linear.out_features)
        a, b = ab["A"], ab["B"]
        in_full, out_full = _target_shape(model, target)
        if a.shape != (r, in_full) or b.shape != (out_full, r):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)}"
                             f", B {tuple(b.shape)}; the model needs A ({r}, "
                             f"{in_full}), B ({out_full}, {r})")
        if _sharded(model):
            a, b = cut_for_rank(model, target, a, b)
        grouped.setdefault((layer, module), []).append((a, b, start, size))
    if not grouped:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA tensors in {where}")
    adapter = LoRAAdapter(name, r, digest=content_digest(cfg, tensors))
    for (layer, module), shards in grouped.items():
        out = layers[layer].get_submodule(module).out_features
        a_all = torch.cat([a for a, _, _, _ in shards]).to(param.dtype)
        b_all = torch.zeros(out, r * len(shards), dtype=torch.float32)
        for i, (_, b, start, size) in enumerate(shards):
            b_all[start:start + size, i * r:(i + 1) * r] = b.float() * scale
        adapter.weights[(layer, module)] = LoRAWeights(
            a_all.to(param.device).contiguous(), b_all.to(param.dtype).to(param.device))
    return adapter
