"""Copy-on-write support: copy whole KV blocks to fresh ones, in every layer, before a forward.

On CPU the native library does it in one call (one memcpy per block, layer and K/V half); on
CUDA one Triton launch per layer (`block_copy_triton.py`); elsewhere, or without either, one
batched index_select / index_copy_ per layer cache (ATen's kernels). Why native on CPU: it is faster for the handful of
blocks a step copies (BENCHMARKS.md, `bench/probes/block_copy.py`).
Sources and destinations are disjoint: destinations are freshly allocated, sources are shared.
"""

from __future__ import annotations

import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.kv_quant import QuantKV


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For each layer cache `[2, num_blocks, block_size, heads, head_dim]`, block dst[i] :=
    block src[i] (keys and values; a quantized cache's scales too)."""
    if src.numel() == 0:
        return
    if kv_caches and isinstance(kv_caches[0], QuantKV):  # the codes as below, then the scales
        for quant in kv_caches:
            quant.scales.index_copy_(1, dst, quant.scales.index_select(1, src))
        kv_caches = [quant.data.view(torch.uint8) for quant in kv_caches]  # bytes: fp8 too
    if src.device.type == "cpu" and cpu_native.copy_blocks(kv_caches, src, dst):
        return
    if src.device.type == "cuda" and _triton_copy() is not None:
        _triton_copy()(kv_caches, src, dst)
        return
    for cache in kv_caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))


def copy_blocks_ref(kv_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """The same, one block at a time (what tests compare `copy_blocks` with)."""
    for cache in kv_caches:
        for s, d in zip(src, dst):
            cache[:, d] = cache[:, s].clone()


def _triton_copy():
    """The Triton copy, or None where Triton cannot be imported."""
    try:
        from kserve_paged_kernels.block_copy_triton import copy_blocks_triton
    except ImportError:
        return None
    return copy_blocks_triton
