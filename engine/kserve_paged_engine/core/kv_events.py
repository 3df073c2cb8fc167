"""KV-cache events: what the prefix cache gained and lost, in the shape vLLM publishes them.

A cache-aware router (llm-d's precise prefix-cache scorer, the inference gateway's endpoint
picker) keeps an index of which pod holds which prefix block. It learns it from three events,
recorded by the block pool as they happen and handed out once per engine step as one batch:

- ``BlockStored``: full blocks that became findable by their hash, one run of a request's chain
  (hashes in chain order, the parent hash of the first, their token ids, the block size);
- ``BlockRemoved``: hashes that stopped being findable (evicted, or never computed);
- ``AllBlocksCleared``: the prefix cache was reset.

Each event names its medium, as vLLM's offloading connector does: the pool's (the publisher's,
"GPU" or "CPU") or, for a block that moved to the second tier (engine/kserve_paged_engine/core/kv_tier/disk.py) or left
it, "DISK": a router then knows the prefix is still on the pod, one copy away.

Wire form (vLLM's msgspec structs with ``array_like`` and ``tag``, so any msgpack reader decodes
it): a batch is ``[timestamp, [event, ...]]``, an event is an array whose first item names it:
``["BlockStored", hashes, parent_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``. The events hold the prefix
cache's own 32-byte keys (engine/kserve_paged_engine/core/block_hash.py, vLLM's); on the wire each is its low 64 bits as an
integer, vLLM's default, or the 32 bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` as there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kserve_paged_engine.core.block_hash import external_block_hash

# vLLM's switch between 64-bit integer hashes on the wire (its default, "1") and raw bytes ("0").
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def int_hashes_from_env() -> bool:
    value = os.environ.get(INT_HASHES_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{INT_HASHES_ENV} must be 0 or 1 (got {value!r})")
    return value == "1"


def _raw(block_hash: bytes) -> bytes:
    return block_hash


WireHash = Callable[[bytes], int | bytes]


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # the adapter's lora_int_id, as vLLM's LoRARequest.id
    medium: str | None = None  # None: the pool's (the publisher's); a tier's when it moved there

    def wire(self, medium: str, h: WireHash = _raw) -> list:
        parent = self.parent_block_hash
        return ["BlockStored", [h(x) for x in self.block_hashes],
                None if parent is None else h(parent), self.token_ids, self.block_size,
                self.lora_id, self.medium or medium]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = None  # None: the pool's; a tier's when the tier let it go

    def wire(self, medium: str, h: WireHash = _raw) -> list:
        return ["BlockRemoved", [h(x) for x in self.block_hashes], self.medium or medium]


@dataclass(slots=True)
class AllBlocksCleared:
    def wire(self, medium: str, h: WireHash = _raw) -> list:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(timestamp: float, events: list[KVCacheEvent], medium: str,
                 int_hashes: bool = True) -> bytes:
    """One step's events as the msgpack payload of one message; `int_hashes`: each hash as its
    low 64 bits (kserve_paged_engine.core.block_hash.external_block_hash), else its 32 bytes."""
    import msgpack  # only when events are switched on

    h = external_block_hash if int_hashes else _raw
    return msgpack.packb([timestamp, [e.wire(medium, h) for e in events]], use_bin_type=True)

