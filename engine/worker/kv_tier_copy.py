"""The byte copies of the second KV tier: blocks out of the KV tensors into host bytes, and
host bytes back into blocks (the policy is engine/core/kv_tier_link.py's).

A block's bytes are its K and V in every slot tensor (each `[2, blocks, block_size, heads,
head_dim]`, engine/core/kv_groups.py), slot after slot: one flat row per block, so a file
holds the whole block and one gather serves a step's evictions. On a GPU the gather lands in
host memory (one device-to-host copy per step); on CPU it is a memcpy, and the disk writes
happen on the tier's writer thread while the step goes on. A quantized cache (`QuantKV`,
--kv-cache-dtype int8/fp8) carries its float32 scales per (K/V half, block, KV head) after the
codes of every slot: a restored block is the stored block, codes and scales alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.core.kv_tier import KVTier
from engine.core.kv_tier_link import TierMoves
from kernels.kv_quant import QuantKV

Cache = torch.Tensor | QuantKV


def _planes(slot_caches: Sequence[Cache]) -> list[torch.Tensor]:
    """The tensors a block's bytes live in, each `[2, blocks, ...]`: every slot's K/V (codes
    of a quantized cache), then every slot's scales (`[2, blocks, heads]`) if quantized."""
    if not isinstance(slot_caches[0], QuantKV):
        return list(slot_caches)
    return [c.data for c in slot_caches] + [c.scales for c in slot_caches]


def gather_blocks(slot_caches: Sequence[Cache], block_ids: Sequence[int]) -> np.ndarray:
    """uint8 `[len(block_ids), block_bytes]`: each block's K/V of every slot, on the host."""
    n = len(block_ids)
    idx = torch.tensor(block_ids, dtype=torch.long, device=slot_caches[0].device)
    parts = [p.index_select(1, idx).transpose(0, 1).contiguous().view(torch.uint8).reshape(n, -1)
             for p in _planes(slot_caches)]
    return torch.cat(parts, dim=1).cpu().numpy()


def scatter_blocks(slot_caches: Sequence[Cache], block_ids: Sequence[int],
                   payloads: Sequence[memoryview | bytes]) -> None:
    """Write each payload (a `gather_blocks` row) into its block, in every slot."""
    planes = _planes(slot_caches)
    host = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads])
    rows = torch.from_numpy(host).to(planes[0].device)
    idx = torch.tensor(block_ids, dtype=torch.long, device=planes[0].device)
    at = 0
    for plane in planes:
        shape = (plane.shape[0], *plane.shape[2:])  # one block's part: [2, ...]
        size = plane[:, 0].numel() * plane.element_size()
        part = rows[:, at:at + size].contiguous().view(plane.dtype)
        plane.index_copy_(1, idx, part.reshape(len(block_ids), *shape).transpose(0, 1))
        at += size


def apply_tier_moves(slot_caches: Sequence[torch.Tensor], moves: TierMoves,
                     tier: KVTier) -> None:
    """Evicted blocks out to the tier first (an allocation may have handed their ids to a
    restore), then the tier's blocks in."""
    if moves.saves:
        rows = gather_blocks(slot_caches, [b for b, _ in moves.saves])
        tier.store([k for _, k in moves.saves], list(rows))
    if moves.loads:
        scatter_blocks(slot_caches, [b for b, _ in moves.loads], [p for _, p in moves.loads])
