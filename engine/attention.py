"""Per-step attention metadata and the attention layer that hands it to the paged kernels.

The model sees one flat batch of new tokens from many sequences; everything the kernels need to
find each token's context in the paged KV cache travels in `AttentionMetadata` (built once per
step by the runner and shared by every layer).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

import kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what context each sequence has.

    slot_mapping: int64 `[num_tokens]`, cache slot of each new token (`< 0`: do not store).
    block_tables: int32 `[num_seqs, max_blocks]`, each sequence's physical blocks in order.
    seq_lens: int32 `[num_seqs]`, context length including the new tokens.
    query_start_loc: int32 `[num_seqs + 1]`, offsets of each sequence's new tokens.
    max_seq_len / max_query_len: host-side maxima, so kernels need no device sync to size grids.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_query_len: int


def attention_rows(meta: AttentionMetadata, num_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every new token as one attention row: the number of keys it sees (int32; its own and
    every earlier token of its sequence, which is how causality is expressed) and its sequence's
    block-table row (int64). None when some tokens belong to no sequence (padding)."""
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = meta.seq_lens.long()
    if bool((q_lens > seq_lens).any()):
        bad = int((q_lens > seq_lens).nonzero()[0, 0])
        raise ValueError(f"sequence {bad}: q_len {int(q_lens[bad])} > seq_len "
                         f"{int(seq_lens[bad])}")
    seq_idx = torch.repeat_interleave(torch.arange(q_lens.numel(), device=qsl.device), q_lens)
    if seq_idx.numel() != num_tokens:
        return None
    offset = torch.arange(seq_idx.numel(), device=qsl.device) - qsl[seq_idx]
    row_lens = (seq_lens - q_lens + 1)[seq_idx] + offset
    return row_lens.to(torch.int32), seq_idx


def _accepts_hints() -> bool:
    """Whether `kernels.paged_attention` takes the keyword-only `max_seq_len`/`max_query_len`."""
    params = inspect.signature(kernels.paged_attention).parameters
    return "max_seq_len" in params and "max_query_len" in params


class Attention(nn.Module):
    """Stores the new K/V in the paged cache, then attends each query over its whole context.

    No weights: projections and RoPE live in the model; this is the seam to the kernels.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self._hints = _accepts_hints()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hk, D]` -> `[T, Hq, D]`."""
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping)
        if self._hints:
            return kernels.paged_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len)
        return kernels.paged_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}")
