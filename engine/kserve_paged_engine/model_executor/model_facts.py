"""A model's facts as the rest of the system may know them, read off the engine's own model.

The one description of a family is its class in `models/`: which layers it has, its heads,
which layers slide, its biases, its experts, how far its RoPE reaches. `ModelFacts.of` reads
the figures sizing needs from a built model; `describe` builds the family's model for a config
on the meta device (no memory, no weights) and reads the same. The engine sizes its KV cache
from the first at start-up, the capacity planner (kserve_paged/plan.py) from the second, so a
new family is described once, by its model code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kserve_paged_engine.model_executor.checkpoint_files import check_architecture
from kserve_paged_engine.model_executor.models import MODEL_REGISTRY, architecture_of
from kserve_paged_engine.model_executor.tp_layout import kv_heads_per_rank


@dataclass(frozen=True, slots=True)
class ModelFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # of this rank's shard when the model is one
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int  # what the positions reach, RoPE scaling included
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None: global
    num_params: int  # distinct parameters (a tied LM head counts once)
    # MLA (DeepSeek): values of the one latent row a token holds per layer (kv_lora_rank +
    # qk_rope_head_dim), stored as num_kv_heads 1 x head_dim latent / 2 in the K and V planes
    # (kernels/kserve_paged_kernels/mla_reference.py); 0: per-head keys and values.
    kv_latent_dim: int = 0

    @classmethod
    def of(cls, model: Any) -> ModelFacts:
        """The facts of a built model (loaded, or on the meta device)."""
        windows = getattr(model, "layer_windows", None) or [None] * model.num_layers
        return cls(architecture=model.architecture, num_layers=model.num_layers,
                   hidden_size=model.hidden_size, num_heads=model.num_heads,
                   num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                   intermediate_size=int(model.config.intermediate_size),
                   vocab_size=model.vocab_size,
                   max_position_embeddings=model.max_position_embeddings,
                   layer_windows=tuple(windows),
                   num_params=sum(p.numel() for p in model.parameters()),
                   kv_latent_dim=int(getattr(model, "kv_latent_dim", 0)))

    def rank_share(self, world: int) -> ModelFacts:
        """The KV heads rank 0 holds under tensor parallelism over `world` ranks (the most any
        rank holds: what sizes every rank's cache), engine/kserve_paged_engine/model_executor/tp_layout.py."""
        return replace(self, num_kv_heads=kv_heads_per_rank(self.num_kv_heads, world))


def describe(config: Any) -> ModelFacts:
    """The facts of the engine's model for a transformers config, built on the meta device."""
    cls = MODEL_REGISTRY[architecture_of(config)]
    with torch.device("meta"):
        model = cls(config)
    return ModelFacts.of(model)


def describe_folder(path: str | Path) -> ModelFacts:
    """`describe` for a model folder, or its config.json alone (no weights needed)."""
    from transformers import AutoConfig

    path = Path(path)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise ValueError(f"no config.json at {folder}")
    check_architecture(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return describe(config)
