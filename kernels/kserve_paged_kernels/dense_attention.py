"""Bidirectional attention of whole sequences over their own K/V, the sequences of a step in a
few padded SDPA calls (encoders: BERT and the like).

Why not the paged path: an encoder computes each prompt whole in one step and keeps nothing
after it, so storing K/V in the paged cache only to gather it back per sequence is wasted work,
and one SDPA per sequence and layer (hundreds of calls a step) costs more in call overhead
than the padding to the step's longest sequence costs in arithmetic. The step's sequences are
laid out once as padded groups of similar length (`DenseBatch`), and every layer gathers its q/k/v
rows into that layout, runs one masked SDPA per group of similar lengths and gathers the
real rows back. Device-agnostic
(torch ops only); the paged `attend(..., causal=False)` stays the contract for any step with
a cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DenseBatch", "DenseGroup", "dense_attention", "dense_batch"]

# A group of sequences is padded to its longest; a sequence shorter than this fraction of it
# starts the next group, so padding stays under a quarter of a group's keys while a step of
# 8-128-token sentences takes about ten calls a layer, not hundreds.
GROUP_FILL = 0.75


@dataclass(slots=True)
class DenseGroup:
    """Sequences of similar length as `[num_seqs, max_len]`: `gather` `[num_seqs * max_len]`
    the flat token row of each padded slot (0 for padding), `mask` `[num_seqs, 1, 1,
    max_len]` True for a real key, None when every sequence of the group is `max_len` long."""

    num_seqs: int
    max_len: int
    gather: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class DenseBatch:
    """A step's sequences in padded groups; `scatter` `[num_tokens]` each token's row in the
    groups' padded outputs laid end to end."""

    groups: list[DenseGroup]
    scatter: torch.Tensor


def _groups(q_lens: list[int]) -> list[list[int]]:
    """Sequence indices, longest first, cut where a length falls under GROUP_FILL of its
    group's first."""
    order = sorted(range(len(q_lens)), key=lambda i: -q_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or q_lens[i] < GROUP_FILL * q_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def dense_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                num_tokens: int) -> DenseBatch | None:
    """The padded layout of a step whose every sequence is whole in it (its new tokens are
    its whole context); None when one is not (a cached prefix: the paged path's case) or when
    some of the `num_tokens` rows belong to no sequence."""
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    if (q_lens.numel() == 0 or int(qsl[-1]) != num_tokens or bool((q_lens <= 0).any())
            or not bool((q_lens == seq_lens.long().cpu()).all())):
        return None
    groups, scatter, base = [], torch.empty(num_tokens, dtype=torch.long), 0
    for members in _groups(q_lens.tolist()):
        idx = torch.tensor(members)
        lens, longest = q_lens[idx], int(q_lens[members[0]])
        real = torch.arange(longest)[None, :] < lens[:, None]
        gather = torch.where(real, qsl[idx][:, None] + torch.arange(longest)[None, :], 0)
        flat = real.reshape(-1)
        scatter[gather.reshape(-1)[flat]] = base + flat.nonzero().squeeze(1)
        base += real.numel()
        mask = None if bool(real.all()) else real[:, None, None, :]
        groups.append(DenseGroup(len(members), longest, gather.reshape(-1), mask))
    dev = query_start_loc.device
    return DenseBatch([DenseGroup(g.num_seqs, g.max_len, g.gather.to(dev),
                                  None if g.mask is None else g.mask.to(dev)) for g in groups],
                      scatter.to(dev))


def dense_attention(qkv: torch.Tensor, num_heads: int, head_dim: int, batch: DenseBatch,
                    scale: float) -> torch.Tensor:
    """Fused `[T, 3 * num_heads * head_dim]` q/k/v rows (q, then k, then v) -> `[T, num_heads
    * head_dim]`, each token over every key of its own sequence: one SDPA per group."""
    outs = []
    for g in batch.groups:
        padded = qkv.index_select(0, g.gather).view(g.num_seqs, g.max_len, 3, num_heads,
                                                    head_dim)
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
        outs.append(out.transpose(1, 2).reshape(g.num_seqs * g.max_len, num_heads * head_dim))
    return torch.cat(outs).index_select(0, batch.scatter)
