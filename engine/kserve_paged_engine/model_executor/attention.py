"""The attention layer: the seam between the model and the paged kernels.

The model sees one flat batch of new tokens from many sequences; everything the kernels need to
find each token's context in the paged KV cache travels in `AttentionMetadata` (the kernels'
contract, `kernels/kserve_paged_kernels/metadata.py`), built once per step by the runner and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import kserve_paged_kernels as kernels
from kserve_paged_kernels import fused_ops
from kserve_paged_kernels.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "GroupedMetadata"]


@dataclass(slots=True)
class GroupedMetadata(AttentionMetadata):
    """A step's metadata when layers are in several KV groups (engine/kserve_paged_engine/core/kv_groups.py): itself is
    group 0's; `groups[g - 1]` is group g's, the same step with that group's block tables and
    slots (and its own kernel plan)."""

    groups: list[AttentionMetadata] = field(default_factory=list)


class Attention(nn.Module):
    """Stores the new K/V in the paged cache, then attends each query over its context: all of
    it, or with `window` its last `window` positions; `softcap` caps the scores (Gemma 2).

    No weights, except a layer with attention sinks (gpt-oss, `add_sinks`): its `sinks`, one
    learned logit per query head added to the softmax's denominator. Projections and RoPE live
    in the model. `kv_group` is the KV group whose block tables the layer reads (set by the
    model runner; 0 when there is one group).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, *,
                 window: int | None = None, softcap: float | None = None,
                 causal: bool = True) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.causal = causal  # False: bidirectional (encoders), every key of the sequence
        self.kv_group = 0
        self.sinks: nn.Parameter | None
        self.register_parameter("sinks", None)  # `add_sinks` gives it one

    def add_sinks(self) -> None:
        """Give the layer a sink logit per query head (`sinks`, loaded with the weights)."""
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, stored: bool = False) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hk, D]` -> `[T, Hq, D]`; `stored`: `rope_store_` has
        already written k and v."""
        meta = self._group_meta(meta)
        if not stored:
            kernels.store_kv(k, v, kv_cache, meta.slot_mapping, backend=meta.backend)
        return kernels.attend(q, kv_cache, meta, self.scale, window=self.window,
                              softcap=self.softcap, causal=self.causal, sinks=self.sinks)

    def rope_store_(self, positions: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """RoPE in place on fused qkv rows plus the K/V store, in one kernel where this step's
        backend has one (`kserve_paged_kernels.fused_ops.rope_store_`); False: nothing done."""
        meta = self._group_meta(meta)
        return fused_ops.rope_store_(qkv, positions, cos, sin, self.num_heads,
                                     self.num_kv_heads, kv_cache, meta.slot_mapping,
                                     backend=meta.backend)

    def _group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.kv_group:
            if not isinstance(meta, GroupedMetadata):
                raise TypeError(f"a layer of KV group {self.kv_group} needs GroupedMetadata "
                                "(the model runner's), not one block table for every layer")
            meta = meta.groups[self.kv_group - 1]
        return meta

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, window={self.window}, softcap={self.softcap}, "
                f"kv_group={self.kv_group}")
