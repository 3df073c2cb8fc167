"""The byte copies of the second KV tier: blocks out of the KV tensors into host bytes, and
host bytes back into blocks (the policy is engine/kserve_paged_engine/core/kv_tier/link.py's).

A block's bytes are its K and V in every slot tensor (each `[2, blocks, block_size, heads,
head_dim]`, engine/kserve_paged_engine/core/kv_groups.py), slot after slot: one flat row per block, so a file
holds the whole block and one gather serves a step's evictions. On a GPU the gather lands in
host memory (one device-to-host copy per step); on CPU it is a memcpy, and the disk writes
happen on the tier's writer thread while the step goes on. A quantized cache (`QuantKV`,
--kv-cache-dtype int8/fp8) carries its float32 scales per (K/V half, block, KV head) after the
codes of every slot: a restored block is the stored block, codes and scales alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HostSlot, HostTier
from kserve_paged_engine.core.kv_tier.link import TierMoves
from kserve_paged_engine.worker.kv_host_copy import SyncCopier
from kserve_paged_kernels.kv_quant import QuantKV

Cache = torch.Tensor | QuantKV


def _planes(slot_caches: Sequence[Cache]) -> list[torch.Tensor]:
    """The tensors a block's bytes live in, each `[2, blocks, ...]`: every slot's K/V (codes
    of a quantized cache), then every slot's scales (`[2, blocks, heads]`) if quantized."""
    if not isinstance(slot_caches[0], QuantKV):
        return list(slot_caches)
    return [c.data for c in slot_caches] + [c.scales for c in slot_caches]


def row_bytes(slot_caches: Sequence[Cache]) -> int:
    """Bytes of one block's `gather_rows` row."""
    return sum(p[:, 0].numel() * p.element_size() for p in _planes(slot_caches))


def gather_rows(slot_caches: Sequence[Cache], block_ids: Sequence[int]) -> torch.Tensor:
    """uint8 `[len(block_ids), block_bytes]`: each block's K/V of every slot, on the device."""
    n = len(block_ids)
    idx = torch.tensor(block_ids, dtype=torch.long, device=slot_caches[0].device)
    parts = [p.index_select(1, idx).transpose(0, 1).contiguous().view(torch.uint8).reshape(n, -1)
             for p in _planes(slot_caches)]
    return torch.cat(parts, dim=1)


def gather_blocks(slot_caches: Sequence[Cache], block_ids: Sequence[int]) -> np.ndarray:
    """`gather_rows` on the host."""
    return gather_rows(slot_caches, block_ids).cpu().numpy()


def scatter_blocks(slot_caches: Sequence[Cache], block_ids: Sequence[int],
                   payloads: Sequence[memoryview | bytes]) -> None:
    """Write each payload (a `gather_blocks` row) into its block, in every slot."""
    host = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads])
    scatter_rows(slot_caches, block_ids, torch.from_numpy(host))


def scatter_rows(slot_caches: Sequence[Cache], block_ids: Sequence[int],
                 rows: torch.Tensor) -> None:
    """Write each row (a `gather_rows` row, on any device) into its block, in every slot."""
    planes = _planes(slot_caches)
    rows = rows.to(planes[0].device)
    idx = torch.tensor(block_ids, dtype=torch.long, device=planes[0].device)
    at = 0
    for plane in planes:
        shape = (plane.shape[0], *plane.shape[2:])  # one block's part: [2, ...]
        size = plane[:, 0].numel() * plane.element_size()
        part = rows[:, at:at + size].contiguous().view(plane.dtype)
        plane.index_copy_(1, idx, part.reshape(len(block_ids), *shape).transpose(0, 1))
        at += size


def gather_rows_at(rows: torch.Tensor, at: Sequence[int]) -> np.ndarray:
    """Some of a step's gathered rows, on the host."""
    return rows.index_select(0, torch.tensor(at, dtype=torch.long, device=rows.device)).cpu().numpy()


def apply_tier_moves(slot_caches: Sequence[torch.Tensor], moves: TierMoves,
                     tier: DiskTier | HostTier) -> None:
    """Evicted blocks out to the tier first (an allocation may have handed their ids to a
    restore), then the tier's blocks in."""
    if isinstance(tier, HostTier):
        apply_host_moves(slot_caches, moves, tier)
        return
    if moves.saves:
        rows = gather_blocks(slot_caches, [b for b, _ in moves.saves])
        tier.store([k for _, k in moves.saves], list(rows))
    if moves.loads:
        scatter_blocks(slot_caches, [b for b, _ in moves.loads],
                       [p for _, p in moves.loads])  # type: ignore[misc] - bytes only here


def apply_host_moves(slot_caches: Sequence[torch.Tensor], moves: TierMoves,
                     tier: HostTier) -> None:
    """The host tier's step: the evicted blocks gathered on the device first (before a load
    or the forward reuses their ids), then the loads (host slots, or bytes from the disk
    below), then the gathered rows into their slots: after the loads, so a slot read this
    step is never the one a save overwrites, and on CUDA overlapping the forward."""
    copier = tier.copier or SyncCopier()
    device = slot_caches[0].device
    rows = gather_rows(slot_caches, [b for b, _ in moves.saves]) if moves.saves else None
    near = [(b, p.slot) for b, p in moves.loads if isinstance(p, HostSlot)]
    far = [(b, p) for b, p in moves.loads if not isinstance(p, HostSlot)]
    if near:
        scatter_rows(slot_caches, [b for b, _ in near],
                     copier.load(tier.host, [s for _, s in near], device))
    if far:
        scatter_blocks(slot_caches, [b for b, _ in far], [p for _, p in far])
    if rows is not None:
        t0 = time.perf_counter()
        keys = [k for _, k in moves.saves]
        placed, direct = tier.place(keys)
        if direct:
            host = gather_rows_at(rows, direct)
            tier.spill_rows([keys[i] for i in direct], [r.tobytes() for r in host])
        if placed:
            pick = torch.tensor([i for i, _ in placed], dtype=torch.long, device=device)
            copier.save(rows.index_select(0, pick), tier.host, [s for _, s in placed])
        tier.stats.write_s += time.perf_counter() - t0
