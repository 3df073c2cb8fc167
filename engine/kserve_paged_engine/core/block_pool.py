"""Physical KV blocks: ref counts, the eviction-ordered free queue, and the prefix-cache index.

A free block may still hold a cached prefix: it stays findable by its hash until allocation pops
it from the head of the free queue, which evicts it. Freed blocks that hold a cached prefix join
the tail, so the one freed longest ago is evicted first. Freed blocks that hold nothing findable
join the head: they are taken before any cached prefix is evicted, and since they were written
recently their memory is warm (a never-touched page costs a fault on first write; on a CPU VM
that can be seconds per GiB, see kserve_paged_engine.worker.kv_prefault).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kserve_paged_engine.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "announced", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.announced = True  # its caching and eviction are KV events (see BlockPool.cache)
        # Links of the free queue; both None when the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, append and removal from the middle.

    A prefix hit on a freed cached block takes it out of the middle of the queue, which a deque
    cannot do in O(1).
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        block.prev_free, block.next_free = self._head, first
        first.prev_free = block
        self._head.next_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free block")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 record_events: bool = False, record_evictions: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_shared_blocks = 0  # blocks held by more than one request (ref_cnt > 1)
        # Blocks saved by sharing: every reference beyond a block's first (prefix hits, forks).
        self.num_shared_refs = 0
        # The most blocks ever held at once (block accounting in tests and bench/).
        self.peak_used = 0
        # KV-cache events since the last take_events() (kserve_paged_engine.core.kv_events); None: not recorded.
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        # Cached blocks evicted by allocations since the last take_evicted(), (id, hash), for
        # the second KV tier (engine/kserve_paged_engine/core/kv_tier/link.py); None: not recorded.
        self.evicted: list[tuple[int, bytes]] | None = [] if record_evictions else None

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the head of the free queue, evicting any cached prefix they hold."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            h = block.block_hash
            if self.evicted is not None and h is not None and self.cached.get(h) is block:
                self.evicted.append((block.block_id, h))
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit or forked blocks, pulling freed ones back out of the
        free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            else:
                if block.ref_cnt == 1:
                    self.num_shared_blocks += 1
                self.num_shared_refs += 1
            block.ref_cnt += 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the given order:
        at the tail if they hold a cached prefix, else at the head (see the module docstring)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            if block.ref_cnt == 2:
                self.num_shared_blocks -= 1
            block.ref_cnt -= 1
            if block.ref_cnt:
                self.num_shared_refs -= 1
            else:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: bytes, announce: bool = True) -> bool:
        """Make a full block findable by its hash; a hash already cached keeps its first block.
        True if the hash became findable now (the caller records the BlockStored event: only it
        knows the tokens and the parent). `announce` False: its eviction is no KV event either
        (a block of a second KV group, whose key is not a hash a router knows)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.announced = announce
        self.cached[block_hash] = block
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None and block.announced:
                    self._record_removed(block.block_hash)
            block.block_hash = None

    def _record_removed(self, block_hash: bytes) -> None:
        """One BlockRemoved per run of consecutive removals (an allocation evicting several)."""
        assert self.events is not None
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """The (block id, hash) of cached blocks evicted since the last call, oldest first:
        their bytes are still there until the next forward writes the blocks."""
        if not self.evicted:
            return []
        evicted, self.evicted = self.evicted, []
        return evicted

    def uncache(self, block: KVBlock) -> None:
        self._uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
