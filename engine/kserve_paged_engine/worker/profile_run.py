"""KV sizing by a profile run on CUDA (issue 32, item 5), vLLM's rule:

    KV bytes = gpu_memory_utilization x total device memory - the non-KV peak

where the non-KV peak is what the process holds at its busiest without a KV cache: the torch
allocator's peak while the largest step runs (weights, activations, logits) plus what is
allocated outside torch (CUDA context, NCCL, cuBLAS workspaces): device memory in use minus
what torch has reserved. An explicit `--kv_cache_memory` or `--num_kv_blocks` wins (the
caller skips the profile). The arithmetic reads memory through an object with torch.cuda's
names (`mem_get_info`, `max_memory_allocated`, `memory_reserved`, ...), so the tests give it
stubbed figures on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total: int  # device memory
    torch_peak: int  # the allocator's peak during the profiled step
    non_torch: int  # in use on the device but not reserved by torch

    @property
    def non_kv_peak(self) -> int:
        return self.torch_peak + self.non_torch

    def kv_budget(self, utilization: float) -> int:
        """Bytes left for the KV cache (0 when the step alone exceeds the share)."""
        return max(0, int(utilization * self.total) - self.non_kv_peak)


def profile_memory(run_step: Callable[[], Any], mem: Any = None) -> MemoryProfile:
    """Run the step once between a reset of the allocator's peak and its reading."""
    mem = torch.cuda if mem is None else mem
    mem.empty_cache()
    mem.reset_peak_memory_stats()
    run_step()
    mem.synchronize()
    free, total = mem.mem_get_info()
    non_torch = max(0, (total - free) - mem.memory_reserved())
    return MemoryProfile(total=total, torch_peak=mem.max_memory_allocated(),
                         non_torch=non_torch)


def largest_step(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 num_tokens: int, num_rows: int, block_size: int) -> Callable[[], None]:
    """A forward of `num_tokens` prompt tokens (one sequence, nothing stored: slots -1) over a
    one-block stand-in cache, and the logits of `num_rows` rows: the activations and logits of
    the largest step the scheduler can make."""
    caches = [torch.zeros(2, 1, block_size, model.num_kv_heads, model.head_dim, dtype=dtype,
                          device=device) for _ in range(model.num_layers)]
    blocks = -(-num_tokens // block_size)

    def run() -> None:
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(1, blocks, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            max_seq_len=num_tokens, max_query_len=num_tokens)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        pos = torch.arange(num_tokens, device=device)
        with torch.inference_mode():
            hidden = model(ids, pos, caches, meta)
            if getattr(model, "lm_head", None) is not None:  # pooling models have none
                model.compute_logits(hidden[:num_rows])
    return run
