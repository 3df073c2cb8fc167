"""Paged-attention kernels: KV store and varlen paged attention (see architecture.md).

Provisional dispatch to the references until the backends land.
"""

from __future__ import annotations

import torch

from kernels.reference import paged_attention_ref, store_kv_ref

__all__ = ["paged_attention", "store_kv"]


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    store_kv_ref(key, value, kv_cache, slot_mapping)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    backend: str | None = None) -> torch.Tensor:
    return paged_attention_ref(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)
