"""Bidirectional attention of whole sequences over their own K/V, all sequences of a step in
one padded SDPA call (encoders: BERT and the like).

Why not the paged path: an encoder computes each prompt whole in one step and keeps nothing
after it, so storing K/V in the paged cache only to gather it back per sequence is wasted work,
and one SDPA per sequence and layer (hundreds of calls a step) costs more in call overhead
than the padding to the step's longest sequence costs in arithmetic. The step's sequences are
laid out as `[num_seqs, max_len]` once (`DenseBatch`), and every layer gathers its q/k/v
rows into that layout, runs one masked SDPA and gathers the real rows back. Device-agnostic
(torch ops only); the paged `attend(..., causal=False)` stays the contract for any step with
a cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DenseBatch", "dense_attention", "dense_batch"]


@dataclass(slots=True)
class DenseBatch:
    """A step's sequences as `[num_seqs, max_len]`: `gather` `[num_seqs * max_len]` the flat
    token row of each padded slot (0 for padding, masked), `mask` `[num_seqs, 1, 1, max_len]`
    True for a real key, `scatter` `[num_tokens]` each token's padded slot."""

    num_seqs: int
    max_len: int
    gather: torch.Tensor
    mask: torch.Tensor
    scatter: torch.Tensor


def dense_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                max_len: int) -> DenseBatch | None:
    """The padded layout of a step whose every sequence is whole in it (its new tokens are
    its whole context); None when one is not (a cached prefix: the paged path's case) or when
    some of the `num_tokens` rows belong to no sequence."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    if q_lens.numel() == 0 or int(qsl[-1]) != num_tokens or not bool(
            (q_lens == seq_lens.long()).all()):
        return None
    pos = torch.arange(max_len, device=qsl.device)
    real = pos[None, :] < q_lens[:, None]
    gather = torch.where(real, qsl[:-1, None] + pos[None, :], 0).reshape(-1)
    scatter = real.reshape(-1).nonzero().squeeze(1)
    return DenseBatch(q_lens.numel(), max_len, gather, real[:, None, None, :], scatter)


def dense_attention(qkv: torch.Tensor, num_heads: int, head_dim: int, batch: DenseBatch,
                    scale: float) -> torch.Tensor:
    """Fused `[T, 3 * num_heads * head_dim]` q/k/v rows (q, then k, then v) -> `[T, num_heads
    * head_dim]`, each token over every key of its own sequence."""
    padded = qkv.index_select(0, batch.gather).view(batch.num_seqs, batch.max_len, 3, num_heads,
                                                    head_dim)
    q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)
    out = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_len, num_heads * head_dim)
    return out.index_select(0, batch.scatter)
