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

from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.block_pool import BlockPool, KVBlock
from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HostSlot, HostTier
from kserve_paged_engine.core.kv_tier.swap import Swapper
from kserve_paged_engine.core.prefix_hits import PrefixHit, extend_block_hashes
from kserve_paged_engine.core.request import Request

# A second tier the link can stand in front of.
Tier = DiskTier | HostTier


@dataclass(slots=True)
class TierMoves:
    """One step's copies, in this order: evicted blocks out to the tier (block id, key), then
    tier blocks into freshly allocated pool blocks (block id, bytes)."""

    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, HostSlot | memoryview | bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class TierLink:
    def __init__(self, tier: DiskTier | HostTier, pool: BlockPool, block_size: int,
                 windows: Sequence[int | None] = (None,)) -> None:
        if list(windows) != [None] or not pool.enable_caching or pool.evicted is None:
            raise ValueError("the second KV tier needs prefix caching, a pool that records its "
                             "evictions, and a model whose layers all attend globally (one KV "
                             "group, no sliding window)")
        self.tier = tier
        self.pool = pool
        self.block_size = block_size
        self._restores: list[tuple[int, bytes]] = []  # (block id, key) allocated this step
        self.swaps = Swapper(tier, block_size)  # preemption by swap (engine/kserve_paged_engine/core/kv_tier/swap.py)
        self._swap_saves: list[tuple[int, bytes]] = []  # (block id, key) of swapped victims

    def swap_out(self, request: Request, blocks: Sequence[KVBlock], hasher: BlockHasher) -> bool:
        """A freed victim (its computed tokens not reset yet): swapped out, or recomputed.
        Forks share blocks: they always recompute (and so does a request asking for
        prompt logprobs, whose resume computes every prompt position)."""
        if (request.fork_root is not None or request.num_computed_tokens == 0
                or request.sampling_params.prompt_logprobs is not None):  # no lookup resumes it
            self.swaps.stats.recomputes += 1
            return False
        extend_block_hashes(hasher, request, self.block_size)
        saves = self.swaps.swap_out(request, blocks)
        self._swap_saves.extend(saves)
        return bool(saves)

    def extend(self, hit: PrefixHit, hashes: Sequence[bytes],
               request: Request | None = None) -> PrefixHit:
        """The pool's hit followed by the tier's run of the next blocks in the chain (and a
        swapped request's partial last block after its full ones)."""
        start = hit.num_tokens // self.block_size
        keys: list[bytes] = []
        for h in hashes[start:]:
            if not self.tier.fetch(h):
                break
            keys.append(h)
        if keys:
            hit = PrefixHit(hit.groups or [[]], hit.num_tokens + len(keys) * self.block_size,
                            tuple(keys))
        return hit if request is None else self.swaps.extend(request, hit)

    def commit(self, keys: Sequence[bytes], new: Sequence[KVBlock]) -> None:
        """The first new blocks of an allocation take the hit's tier blocks, in order."""
        assert len(new) >= len(keys), "a tier hit's tokens get fresh blocks"
        self._restores.extend((b.block_id, k) for b, k in zip(new, keys))

    def record(self, request: Request, hit: PrefixHit) -> int:
        """An admitted request's lookup: the blocks asked of the tier and those it had, and
        its swap-in. Returns the tokens of a swapped partial block in the hit (no prefix's)."""
        num_full = (request.num_tokens - 1) // self.block_size
        swapped = self.swaps.admitted(request, hit)
        prefix = len(hit.restore) - (swapped > 0)
        pool_blocks = hit.num_tokens // self.block_size - prefix
        self.tier.count(max(num_full - pool_blocks, 0), hit.restore[:prefix])
        return swapped

    def take(self, keep_saves: bool = False) -> TierMoves:
        """This step's copies; a block evicted again that the tier holds only gets fresher.
        `keep_saves`: the step runs no forward, so the blocks to save keep their bytes until
        the next one, which saves them."""
        loads = [(block_id, self.tier.take(key)) for block_id, key in self._restores]
        self._restores = []
        done = set(self.swaps.done)
        for key in self.swaps.done:  # read back (just above) or abandoned
            self.tier.discard(key)
        self.swaps.done = []
        self.tier.end_step()
        if keep_saves:
            return TierMoves([], loads)
        saves: list[tuple[int, bytes]] = []
        seen: set[bytes] = set()
        for block_id, key in self._swap_saves + self.pool.take_evicted():
            if key in self.tier:
                self.tier.touch(key)
            elif key not in seen and key not in done:
                seen.add(key)
                saves.append((block_id, key))
        self._swap_saves = []
        return TierMoves(saves, loads)
