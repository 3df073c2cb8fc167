"""The byte copies of the second KV tier: blocks out of the KV tensors into host bytes, and
host bytes back into blocks (the policy is engine/core/kv_tier_link.py's).

A block's bytes are its K and V in every slot tensor (each `[2, blocks, block_size, heads,
head_dim]`, engine/core/kv_groups.py), slot after slot: one flat row per block, so a file
holds the whole block and one gather serves a step's evictions. On a GPU the gather lands in
host memory (one device-to-host copy per step); on CPU it is a memcpy, and the disk writes
happen on the tier's writer thread while the step goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.core.kv_tier import KVTier
from engine.core.kv_tier_link import TierMoves


def gather_blocks(slot_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """uint8 `[len(block_ids), block_bytes]`: each block's K/V of every slot, on the host."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=slot_caches[0].device)
    parts = [c.index_select(1, idx).transpose(0, 1) for c in slot_caches]  # [n, 2, bs, h, d]
    rows = torch.stack(parts, dim=1).contiguous()  # [n, slots, 2, bs, h, d]
    flat = rows.reshape(len(block_ids), -1).cpu()
    return flat.view(torch.uint8).numpy()


def scatter_blocks(slot_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                   payloads: Sequence[memoryview | bytes]) -> None:
    """Write each payload (a `gather_blocks` row) into its block, in every slot."""
    first = slot_caches[0]
    host = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads])
    rows = torch.from_numpy(host).view(first.dtype).to(first.device)
    rows = rows.reshape(len(block_ids), len(slot_caches), *first[:, 0].shape)
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for s, cache in enumerate(slot_caches):
        cache.index_copy_(1, idx, rows[:, s].transpose(0, 1))


def apply_tier_moves(slot_caches: Sequence[torch.Tensor], moves: TierMoves,
                     tier: KVTier) -> None:
    """Evicted blocks out to the tier first (an allocation may have handed their ids to a
    restore), then the tier's blocks in."""
    if moves.saves:
        rows = gather_blocks(slot_caches, [b for b, _ in moves.saves])
        tier.store([k for _, k in moves.saves], list(rows))
    if moves.loads:
        scatter_blocks(slot_caches, [b for b, _ in moves.loads], [p for _, p in moves.loads])
