"""The second KV tier under tensor parallelism: each rank copies its own heads of a block out
of and into its own KV tensors; rank 0's tier keeps them together, one file per block.

A block's file holds every rank's row (`kv_tier_copy.gather_rows`: its K/V and, quantized, its
scales, for that rank's KV heads) in rank order. Rank 0 owns the one index, eviction policy,
lookups and checks (engine/kserve_paged_engine/core/kv_tier/), so a file is whole or a miss
for every rank at once: the ranks can never disagree about a hit, which a file per rank
would allow (one rank's file missing or corrupt, the others' not). The cost is the gather of
the other ranks' rows to rank 0 on a save and their scatter on a restore, as objects over the
group (a block is one step's copy, not per layer). The tier's identity carries the
tensor-parallel size (core/kv_tier/identity.py): a store written at one size, whose files
cut the heads another way, is never read at another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.link import TierMoves
from kserve_paged_engine.worker.kv_tier_copy import gather_blocks, row_bytes, scatter_rows


def rank_kv_heads(model: Any) -> list[int]:
    """Each rank's KV heads in rank order (one entry without tensor parallelism)."""
    layout = getattr(model, "layout", None)
    if getattr(model, "tp", None) is None or layout is None:
        return [model.num_kv_heads]
    return [dataclasses.replace(layout, rank=r).kv_heads[1] for r in range(layout.world)]


def rank_row_bytes(slot_caches: Sequence[Any], model: Any) -> list[int]:
    """Bytes of each rank's part of a block's file: rank 0's row scaled by its heads (every
    part of a row, codes and scales, is per KV head)."""
    heads = rank_kv_heads(model)
    per_head = row_bytes(slot_caches) // heads[0]
    return [per_head * h for h in heads]


def rank0_moves(slot_caches: Sequence[Any], moves: TierMoves, tier: DiskTier,
                sizes: Sequence[int]) -> None:
    """Rank 0's side of a step's tier copies (after the step's broadcast told the others the
    block ids): evicted blocks' rows gathered from every rank and stored as one file each,
    then restored files cut by rank and scattered."""
    if moves.saves:
        mine = gather_blocks(slot_caches, [b for b, _ in moves.saves])
        parts: list[Any] = [None] * len(sizes)
        dist.gather_object(mine, parts, dst=0)
        rows = np.concatenate(parts, axis=1)
        tier.store([k for _, k in moves.saves], list(rows))
    if moves.loads:
        host = np.stack([np.frombuffer(p, dtype=np.uint8) for _, p in moves.loads])
        cuts = np.cumsum([0, *sizes])
        pieces = [np.ascontiguousarray(host[:, cuts[r]:cuts[r + 1]]) for r in range(len(sizes))]
        box: list[Any] = [None]
        dist.scatter_object_list(box, pieces, src=0)
        scatter_rows(slot_caches, [b for b, _ in moves.loads], torch.from_numpy(box[0]))


def worker_moves(slot_caches: Sequence[Any], saves: Sequence[int], loads: Sequence[int]) -> None:
    """A worker's side of `rank0_moves`: its rows of the saved blocks to rank 0, then its part
    of the restored ones into its cache."""
    if saves:
        dist.gather_object(gather_blocks(slot_caches, saves), None, dst=0)
    if loads:
        box: list[Any] = [None]
        dist.scatter_object_list(box, None, src=0)
        scatter_rows(slot_caches, loads, torch.from_numpy(box[0]))
