"""Weights from a transformers checkpoint into the engine's Llama-family modules: which names a
model needs, and where each tensor goes, q/k/v and gate/up fused into their shards (under tensor
parallelism, this rank's slice of each, cut by engine/kserve_paged_engine/model_executor/tp_layout.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# Checkpoint entries that carry no weights we need (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# Under tensor parallelism: checkpoint tensors cut by vocabulary, and biases added once.
_VOCAB_SHARDED = ("embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL_BIASES = ("o_proj.bias", "down_proj.bias")

# transformers' unfused projection -> (our fused module, shard name).
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}




class TransformersCheckpoint(nn.Module):
    """A model whose parameters load from transformers' names. Subclasses set `architecture`,
    `tie_word_embeddings`, `num_heads`, `num_kv_heads`, `head_dim`, `layout` and `tp` (the
    tensor-parallel layout and group, None without)."""

    architecture: str
    tie_word_embeddings: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layout: Any = None
    tp: Any = None

    def expected_weights(self) -> set[str]:
        """transformers' parameter names this model needs from a checkpoint."""
        names: set[str] = set()
        # Phi-3 checkpoints store qkv_proj and gate_up_proj fused, in our layout already.
        fused_checkpoint = self.architecture == "Phi3ForCausalLM"
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if fused_checkpoint:
                names.add(name)
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module == "qkv_proj":
                names.update(f"{parent}.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj"))
            elif module == "gate_up_proj":
                names.update(f"{parent}.{p}.{leaf}" for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in, fusing q/k/v and gate/up into their shards.

        Raises ValueError for a tensor we have no place for, a shape mismatch, or any needed
        tensor the checkpoint lacks.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.expected_weights()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: transformers ignores a saved copy too
            if hf_name not in expected:
                unexpected.append(hf_name)
                continue
            target = self._target(hf_name, params)
            if self.layout is not None and hf_name.endswith(_VOCAB_SHARDED):
                target = target.narrow(0, 0, tensor.shape[0])  # the last shard's padding
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"model shape {tuple(target.shape)}")
            if self.tp is not None and self.tp.rank and hf_name.endswith(_ROW_PARALLEL_BIASES):
                target.zero_()  # the all-reduce adds rank 0's copy once
            else:
                target.copy_(tensor)
            loaded.add(hf_name)
        if unexpected:
            raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this "
                             f"{self.architecture} has no place for, e.g. {sorted(unexpected)[:5]}")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. "
                             f"{sorted(missing)[:5]}")

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Where a checkpoint tensor goes: its parameter, or its shard of a fused one."""
        module_path, _, leaf = hf_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return self._shard(params[f"{parent}.{fused}.{leaf}"], fused, shard)
        return params[hf_name]

    def _shard(self, param: torch.Tensor, fused: str, shard: str) -> torch.Tensor:
        """The rows of a fused weight/bias that one unfused projection fills."""
        if fused == "qkv_proj":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:
            inter = param.shape[0] // 2
            start, size = (0, inter) if shard == "gate" else (inter, inter)
        return param.narrow(0, start, size)
