"""Copy-on-write block copy on CUDA: one Triton launch per layer cache moving every block of
the step (K and V halves), instead of index_select + index_copy_ (two launches and a temporary
per layer). Tested against `block_copy.copy_blocks_ref` in Triton's interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, half_elems, block_elems,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    off = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = off < block_elems
    base = cache_ptr + kv * half_elems
    tl.store(base + dst * block_elems + off, tl.load(base + src * block_elems + off, mask=ok),
             mask=ok)


def copy_blocks_triton(kv_caches: list[torch.Tensor], src: torch.Tensor,
                       dst: torch.Tensor) -> None:
    """For each contiguous layer cache `[2, num_blocks, ...]`, block dst[i] := block src[i]."""
    n = src.numel()
    if n == 0:
        return
    for cache in kv_caches:
        if not cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        block_elems = cache[0, 0].numel()
        block = min(4096, triton.next_power_of_2(block_elems))
        _copy_blocks_kernel[(n, 2, triton.cdiv(block_elems, block))](
            cache, src, dst, cache[0].numel(), block_elems, BLOCK=block)
