"""The attention layer: the seam between the model and the paged kernels.

The model sees one flat batch of new tokens from many sequences; everything the kernels need to
find each token's context in the paged KV cache travels in `AttentionMetadata` (the kernels'
contract, `kernels/metadata.py`), built once per step by the runner and shared by every layer.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]


class Attention(nn.Module):
    """Stores the new K/V in the paged cache, then attends each query over its context: all of
    it, or with `window` its last `window` positions; `softcap` caps the scores (Gemma 2).

    No weights: projections and RoPE live in the model.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, *,
                 window: int | None = None, softcap: float | None = None) -> None:
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hk, D]` -> `[T, Hq, D]`."""
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping, backend=meta.backend)
        return kernels.attend(q, kv_cache, meta, self.scale, window=self.window,
                              softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, window={self.window}, softcap={self.softcap}")
