"""The KV-cache manager's side of the second tier: which evicted blocks go down, which tier
blocks a prefix lookup may take, and the copies the model runner does before the next forward.

A tier hit is only more computed prefix: the lookup extends the pool's hit with the blocks the
tier holds next in the chain (each read and checked now, so a corrupt file shortens the hit
instead of feeding the forward wrong K/V), the allocation gives those tokens fresh blocks, and
the runner copies the bytes in before the forward, as it does copy-on-write copies. The
scheduler still sees one number per request. Blocks go down when an allocation evicts them from
the pool: their bytes are still in place until the next forward, which copies them out first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool, KVBlock
from engine.core.kv_tier import KVTier
from engine.core.prefix_hits import PrefixHit


@dataclass(slots=True)
class TierMoves:
    """One step's copies, in this order: evicted blocks out to the tier (block id, key), then
    tier blocks into freshly allocated pool blocks (block id, bytes)."""

    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, memoryview | bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class TierLink:
    def __init__(self, tier: KVTier, pool: BlockPool, block_size: int,
                 windows: Sequence[int | None] = (None,)) -> None:
        if list(windows) != [None] or not pool.enable_caching:
            raise ValueError("the second KV tier needs prefix caching and a model whose "
                             "layers all attend globally (one KV group, no sliding window)")
        self.tier = tier
        self.pool = pool
        self.block_size = block_size
        pool.evicted = []  # the pool now records what allocations evict
        self._restores: list[tuple[int, bytes]] = []  # (block id, key) allocated this step

    def extend(self, hit: PrefixHit, hashes: Sequence[bytes]) -> PrefixHit:
        """The pool's hit followed by the tier's run of the next blocks in the chain."""
        start = hit.num_tokens // self.block_size
        keys: list[bytes] = []
        for h in hashes[start:]:
            if not self.tier.fetch(h):
                break
            keys.append(h)
        if not keys:
            return hit
        return PrefixHit(hit.groups or [[]], hit.num_tokens + len(keys) * self.block_size,
                         tuple(keys))

    def commit(self, keys: Sequence[bytes], new: Sequence[KVBlock]) -> None:
        """The first new blocks of an allocation take the hit's tier blocks, in order."""
        assert len(new) >= len(keys), "a tier hit's tokens get fresh blocks"
        self._restores.extend((b.block_id, k) for b, k in zip(new, keys))

    def record(self, hit: PrefixHit, num_full: int) -> None:
        """An admitted request's lookup: the blocks asked of the tier and those it had."""
        pool_blocks = hit.num_tokens // self.block_size - len(hit.restore)
        self.tier.stats.queries += max(num_full - pool_blocks, 0)
        self.tier.stats.hits += len(hit.restore)

    def take(self) -> TierMoves:
        """This step's copies; a block evicted again that the tier holds only gets fresher."""
        saves: list[tuple[int, bytes]] = []
        for block_id, key in self.pool.take_evicted():
            if key in self.tier:
                self.tier.touch(key)
            else:
                saves.append((block_id, key))
        loads = [(block_id, self.tier.take(key)) for block_id, key in self._restores]
        self._restores = []
        self.tier.end_step()
        return TierMoves(saves, loads)
