"""The host-memory KV tier: on a GPU server, blocks evicted from the device pool (and swapped
victims) are kept in pinned host memory, keyed by the prefix cache's block hash, and copied
back on a later prefix hit. An `fs` tier, when configured, is the level below it: a block the
host tier lets go is written to disk, and a lookup that misses in host memory asks the disk.

The bytes live in one preallocated `[slots, block_bytes]` uint8 tensor (pinned where CUDA is
available), so a step's saves and loads are copies between slots and pool blocks, done by a
copy engine (engine/kserve_paged_engine/worker/kv_host_copy.py): synchronous on CPU, on a side CUDA stream ordered
by events on a GPU. Which block leaves first is the eviction policy's (LRU or ARC,
engine/kserve_paged_engine/core/kv_tier/policy.py), as for the disk tier. On a CPU server the pool already lives in
host memory and this tier adds nothing; tests build it there on purpose to test its logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kserve_paged_engine.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kserve_paged_engine.core.kv_tier.disk import DiskTier, TierStats
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from kserve_paged_engine.core.kv_tier.policy import make_policy

HOST_MEDIUM = "CPU"  # vLLM's medium name for blocks in host memory
DEFAULT_COPY_BPS = 10e9  # a host<->device copy's rate (PCIe class), fixed: the copies overlap


class HostCopier(Protocol):
    """Copies between device rows and host slots (engine/kserve_paged_engine/worker/kv_host_copy.py)."""

    def save(self, rows: torch.Tensor, host: torch.Tensor, slots: Sequence[int]) -> None: ...

    def load(self, host: torch.Tensor, slots: Sequence[int],
             device: torch.device) -> torch.Tensor: ...

    def sync(self) -> None: ...


@dataclass(frozen=True, slots=True)
class HostSlot:
    """A load's source in host memory (a load from the disk below carries bytes instead)."""

    slot: int


class HostTier:
    """Slots of host memory indexed by block key, and the disk tier below them (or none)."""

    def __init__(self, block_bytes: int, capacity_bytes: int, block_size: int = 16,
                 policy: str = "lru", lower: DiskTier | None = None,
                 pin: bool | None = None, copier: HostCopier | None = None) -> None:
        self.capacity_blocks = capacity_bytes // block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"the host KV tier holds no block: cpu_bytes_to_use "
                             f"{capacity_bytes} for blocks of {block_bytes} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.host = torch.empty((self.capacity_blocks, block_bytes), dtype=torch.uint8,
                                pin_memory=pin)
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.lower = lower
        self.index = make_policy(policy, self.capacity_blocks)
        self.slots: dict[bytes, int] = {}
        self.free = list(range(self.capacity_blocks - 1, -1, -1))  # popped lowest first
        self.events: list[KVCacheEvent] = []
        self.stats = TierStats()
        self.private: set[bytes] = set()  # swapped partial blocks: never announced
        self.write_rate = MeasuredRate(DEFAULT_COPY_BPS)  # what a swap-out would cost
        self.read_rate = MeasuredRate(DEFAULT_COPY_BPS)
        self.last_error: float | None = None  # host copies do not fail like a disk
        self.copier = copier  # None: copies are synchronous

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    @property
    def usage(self) -> float:
        return len(self.slots) / self.capacity_blocks

    def __contains__(self, key: bytes) -> bool:
        """Held in host memory (a block only on disk is copied up when evicted again)."""
        return key in self.slots

    def fetch(self, key: bytes) -> bool:
        """A lookup: in host memory, else on the disk below (read and checked there)."""
        if key in self.slots:
            self.index.touch(key)
            return True
        return self.lower is not None and self.lower.fetch(key)

    def take(self, key: bytes) -> HostSlot | memoryview | bytes:
        """A fetched block's source for the copy into the pool."""
        slot = self.slots.get(key)
        if slot is None:
            assert self.lower is not None
            return self.lower.take(key)
        self.stats.bytes_read += self.block_bytes
        return HostSlot(slot)

    def place(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int]], list[int]]:
        """Slots for the keys not held yet, as (index in keys, slot), and the indexes of keys
        let go again within this call (more new keys than slots): their bytes, not in a slot
        yet, go to the disk below from the caller's rows (`spill_rows`). Keys held only get
        fresher; room is made first (blocks let go spill to the disk below)."""
        fresh: dict[bytes, int] = {}
        direct: list[int] = []
        for i, key in enumerate(keys):
            if key in self.slots:
                self.index.touch(key)
                continue
            for old in self.index.insert(key):
                placed_now = old in fresh  # by this call: no bytes in its slot yet
                if placed_now:
                    direct.append(fresh.pop(old))
                self._evict(old, spill=not placed_now)
            self.slots[key] = self.free.pop()
            fresh[key] = i
            self._event(key, stored=True)
        self.stats.bytes_written += len(fresh) * self.block_bytes
        return [(i, self.slots[keys[i]]) for i in fresh.values()], sorted(direct)

    def spill_rows(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        """Blocks let go before they reached a slot, straight to the disk below."""
        if self.lower is None:
            return
        for key, payload in zip(keys, payloads):
            if key in self.private:
                self.lower.private.add(key)
                self.private.discard(key)
            self.lower.store([key], [payload])

    def touch(self, key: bytes) -> None:
        self.index.touch(key)

    def _evict(self, key: bytes, spill: bool = True) -> None:
        slot = self.slots.pop(key)
        if spill and self.lower is not None:
            if self.copier is not None:
                self.copier.sync()  # the slot's bytes must have landed before the CPU reads
            if key in self.private:
                self.lower.private.add(key)
            self.lower.store([key], [self.host[slot].numpy().tobytes()])
        self.free.append(slot)
        self.stats.evictions += 1
        self._event(key, stored=False)
        if spill:
            self.private.discard(key)

    def _event(self, key: bytes, stored: bool) -> None:
        """One BlockStored / BlockRemoved per run of the same kind, medium CPU."""
        if key in self.private:
            return
        last = self.events[-1] if self.events else None
        kind = BlockStored if stored else BlockRemoved
        if isinstance(last, kind) and last.medium == HOST_MEDIUM:
            last.block_hashes.append(key)
        elif stored:
            self.events.append(BlockStored([key], None, [], self.block_size, None, HOST_MEDIUM))
        else:
            self.events.append(BlockRemoved([key], HOST_MEDIUM))

    def discard(self, key: bytes) -> None:
        """Let a block go that no one will ask for again (a swap read back, or abandoned)."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.index.remove(key)
            self.free.append(slot)
            self._event(key, stored=False)
        if self.lower is not None:
            self.lower.discard(key)
        self.private.discard(key)

    def count(self, queries: int, keys: Sequence[bytes]) -> None:
        """An admitted request's lookup: blocks asked of the tiers, and those found where."""
        here = sum(k in self.slots for k in keys)
        self.stats.queries += queries
        self.stats.hits += here
        if self.lower is not None:
            self.lower.count(queries - here, keys[here:])

    def end_step(self) -> None:
        if self.lower is not None:
            self.lower.end_step()

    def stat_dict(self) -> dict[str, int | float]:
        """The host tier's stats under `kv_host_tier_*` (metrics label tier "0:CPU"), the
        disk's under `kv_tier_*` ("1:fs")."""
        st = self.stats
        out: dict[str, int | float] = {
            "kv_host_tier_block_queries": st.queries, "kv_host_tier_block_hits": st.hits,
            "kv_host_tier_read_bytes": st.bytes_read, "kv_host_tier_write_bytes":
            st.bytes_written, "kv_host_tier_read_time": st.read_s,
            "kv_host_tier_write_time": st.write_s, "kv_host_tier_evictions": st.evictions,
            "kv_host_tier_blocks": len(self.slots), "kv_host_tier_usage": self.usage}
        return out | (self.lower.stat_dict() if self.lower is not None else {})

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events + (self.lower.take_events() if self.lower is not None else [])

    def close(self) -> None:
        if self.copier is not None:
            self.copier.sync()
        if self.lower is not None:
            self.lower.close()
