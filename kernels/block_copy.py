"""Copy-on-write support: copy whole KV blocks to fresh ones, in every layer, before a forward.

One batched index_select / index_copy_ per layer cache, so it runs as is on CPU and CUDA (a
handful of blocks per step after a fork; not worth a dedicated kernel). Sources and
destinations are disjoint: destinations are freshly allocated, sources are shared.
"""

from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For each layer cache `[2, num_blocks, block_size, heads, head_dim]`, block dst[i] :=
    block src[i] (keys and values)."""
    if src.numel() == 0:
        return
    for cache in kv_caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))


def copy_blocks_ref(kv_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """The same, one block at a time (what tests compare `copy_blocks` with)."""
    for cache in kv_caches:
        for s, d in zip(src, dst):
            cache[:, d] = cache[:, s].clone()
