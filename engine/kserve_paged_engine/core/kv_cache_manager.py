"""The scheduler's only door to KV memory: prefix lookup, all-or-nothing allocation, forks
with copy-on-write, free.

A request has one block table per KV group (engine/kserve_paged_engine/core/kv_groups.py): one for a model whose layers
are all of one kind, one per group of global or sliding-window layers otherwise (Gemma 2/3).
Every group allocates from the one pool, so the scheduler's question "are there n free
blocks?" is answered by summing the groups' needs. A sliding group's leading blocks that its
window no longer reaches are released as the request advances (`free_out_of_window`): its
table keeps their positions (None in the table, the old id in the plain ids, which no windowed
kernel reads), so later blocks keep their indices. Full blocks stay in the prefix cache while
free, so a later prompt with the same prefix can still hit them; a hit needs a global group's
blocks from block 0 and a sliding group's blocks for the window before the hit's end.
"""

from __future__ import annotations

from collections.abc import Iterator

from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.block_pool import BlockPool, KVBlock
from kserve_paged_engine.core.kv_events import BlockStored
from kserve_paged_engine.core.kv_tier.link import Tier, TierLink, TierMoves
from kserve_paged_engine.core.prefix_hits import (
    NO_HIT,
    PrefixHit,
    cached_hit,
    extend_block_hashes,
    first_in_window,
    sibling_blocks,
)
from kserve_paged_engine.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, hash_algo: str = "sha256",
                 group_windows: list[int | None] | None = None, *,
                 hasher: BlockHasher | None = None, tier: Tier | None = None,
                 record_events: bool = False) -> None:
        """`group_windows`: each KV group's sliding window (None: global); without it one
        group, sliding by `sliding_window` (every layer slides) or global. `hasher` (else one
        of `hash_algo`): the keys the second `tier` (evicted blocks kept, taken back on
        lookups) names its blocks by. `record_events`: for KV-cache event publishing."""
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(hash_algo)  # vLLM's block keys (block_hash.py)
        self.enable_prefix_caching = enable_prefix_caching
        self.windows: list[int | None] = list(group_windows or [sliding_window])
        self.sliding_window = self.windows[0] if len(self.windows) == 1 else None
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_events, tier is not None)
        # Per group, a request's blocks in table order; None: released out of the window.
        self._tables: list[dict[str, list[KVBlock | None]]] = [{} for _ in self.windows]
        # The same tables as plain ids, grown alongside: the runner reads them every step.
        self._ids: list[dict[str, list[int]]] = [{} for _ in self.windows]
        self._dropped: list[dict[str, int]] = [{} for _ in self.windows]  # leading entries None
        self.req_blocks = self._tables[0]  # the first group's (the only one for most models)
        self.req_block_ids = self._ids[0]
        self.num_window_freed = 0  # blocks released out of the window, in total
        # How many of a request's leading blocks are registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Prefix-cache accounting, in tokens (what vLLM's metrics count).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Copy-on-write copies (source id, destination id) since the last `take_block_copies`.
        self._pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self.tier = None if tier is None else TierLink(tier, self.pool, block_size, self.windows)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _key(self, group: int, block_hash: bytes) -> bytes:
        """A block's prefix-cache key in a group: the same tokens are other bytes in another
        group's layers. The first group's key is the plain hash (what KV events announce)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    # ---------------------------------------------------------------- API
    def find_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks matching the request's leading tokens: in every global group from
        block 0, in every sliding group for the window before the hit's end (a hit is cut back
        until each group has what it needs).

        The hit stops short of the last token, whose logits must be computed, and is counted in
        the prefix-cache metrics only when the request is admitted (see `record_lookup`).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT  # prompt logprobs need logits at every prompt position
        extend_block_hashes(self.hasher, request, self.block_size)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        hit = cached_hit(hashes, self.windows, self.block_size,
                         lambda g, h: self.pool.lookup(self._key(g, h)))
        return hit if self.tier is None else self.tier.extend(hit, hashes, request)

    def sibling_hit(self, request: Request, sibling: Request, num_valid: int) -> PrefixHit:
        """Full blocks of a sibling (a fork of the same group) that `request` can take after
        the blocks it holds: blocks of their common tokens among the sibling's first
        `num_valid` (written by the end of this step's store), never the block of the request's
        last token; in a sliding group only those the window before the hit's end reaches.
        Forks share blocks this way even with prefix caching off, so a group recomputed after
        a preemption holds its common history once again."""
        bs = self.block_size
        held = len(self.req_blocks.get(request.request_id) or [])
        if request.num_computed_tokens != held * bs:
            return NO_HIT  # a partial block of its own comes first
        last = min(request.common_prefix_len(sibling), num_valid, request.num_tokens - 1) // bs
        if last <= held:
            return NO_HIT
        return sibling_blocks(held, last, self.windows, bs,
                              [t.get(sibling.request_id, []) for t in self._tables])

    def record_lookup(self, request: Request, hit: PrefixHit) -> None:
        if self.enable_prefix_caching:  # a swapped request's own partial block: no prefix hit
            swapped = 0 if self.tier is None else self.tier.record(request, hit)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens - swapped

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit = NO_HIT) -> bool:
        """Make room, in every group, for `num_new_tokens` after the request's computed (and
        hit) tokens.

        All or nothing: on failure no ref count, free-queue position or cache entry changes.
        """
        rid = request.request_id
        total = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_free_blocks:
            return False
        if rid not in self.req_blocks:
            for g in range(self.num_groups):
                self._tables[g][rid] = []
                self._ids[g][rid] = []
            self._num_registered[rid] = 0
        # Every group's hit blocks first: a later group's free hit block must not be popped
        # as an earlier group's new block (or copy) before it is taken.
        self.pool.touch([b for taken in hit.groups for b in taken if b is not None])
        for g in range(self.num_groups):
            held, ids = self._tables[g][rid], self._ids[g][rid]
            for i in self._shared_written(request, held, total):
                self._copy_on_write(held, ids, i)
            if hit.groups and hit.groups[g]:
                taken = hit.groups[g]
                held.extend(taken)
                ids.extend(0 if b is None else b.block_id for b in taken)
                self._num_registered[rid] = len(held)  # the hit's blocks are cached already
            num_new_blocks = -(-total // self.block_size) - len(held)
            if num_new_blocks > 0:
                new = self.pool.allocate(num_new_blocks)
                if hit.restore and self.tier is not None and g == 0:
                    self.tier.commit(hit.restore, new)
                held.extend(new)
                ids.extend(b.block_id for b in new)
        self._register_full_blocks(request, min(total, request.num_tokens))
        return True

    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Free blocks an allocation would consume, over all groups: new blocks plus hit blocks
        that are free (taking those out of the free queue uses them up as room for new
        blocks)."""
        total = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        need = 0
        for g in range(self.num_groups):
            held = self._tables[g].get(request.request_id)
            taken = hit.groups[g] if hit.groups else []
            new = -(-total // self.block_size) - (len(held) if held else 0) - len(taken)
            cow = len(self._shared_written(request, held, total)) if held else 0
            need += max(new, 0) + sum(1 for b in taken if b is not None and b.ref_cnt == 0) + cow
        return need

    def blocks_needed_together(self, asks: list[tuple[Request, int]]) -> int:
        """Free blocks that allocating for all these running requests, one after another,
        consumes: a shared block that every holder writes into is copied by all but the last,
        which then owns it."""
        total_new = 0
        writers: dict[int, int] = {}
        shared: dict[int, KVBlock] = {}
        for request, num_new in asks:
            total = request.num_computed_tokens + num_new
            for table in self._tables:
                held = table.get(request.request_id)
                total_new += max(-(-total // self.block_size) - (len(held) if held else 0), 0)
                for i in self._shared_written(request, held, total):
                    b = held[i]
                    writers[b.block_id] = writers.get(b.block_id, 0) + 1
                    shared[b.block_id] = b
        cow = sum(n - (n == shared[i].ref_cnt) for i, n in writers.items())
        return total_new + cow

    def _shared_written(self, request: Request, held: list[KVBlock | None] | None,
                        total: int) -> list[int]:
        """Indices of held blocks that the coming tokens write into while others hold them too
        (after a fork only the partial last block can be one: full blocks are never written)."""
        if not held:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min(-(-total // self.block_size), len(held))
        return [i for i in range(first, last) if held[i] is not None and held[i].ref_cnt > 1]

    def _copy_on_write(self, held: list[KVBlock | None], ids: list[int], i: int) -> None:
        """Give the request its own copy of shared block i before it writes there."""
        old = held[i]
        assert old is not None
        (new,) = self.pool.allocate(1)
        self._pending_copies.append((old.block_id, new.block_id))
        self.pool.free([old])
        held[i], ids[i] = new, new.block_id
        self.num_cow_copies += 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies to do before the next forward, handed over once (a block
        id names its bytes in every slot tensor, so one copy list serves every group)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_tier_moves(self, runs: bool = True) -> TierMoves | None:
        """The second tier's copies for the next forward (None: no tier; see TierLink.take)."""
        return self.tier.take(keep_saves=not runs) if self.tier is not None else None

    def preempt(self, request: Request) -> bool:
        """Free a preempted request's blocks, swapped out to the second tier first if the
        cost model says so (TierLink.swap_out); True: swapped. Computed tokens reset after."""
        blocks = list(self.held_blocks(request.request_id))
        self.free(request)
        return self.tier is not None and self.tier.swap_out(request, blocks, self.hasher)

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block tables, every block shared (counts raised): full
        blocks stay shared for good, a partial last block until one of them writes into it."""
        if child.request_id in self.req_blocks:
            raise RuntimeError(f"{child.request_id!r} already holds blocks")
        for g in range(self.num_groups):
            blocks = self._tables[g].get(parent.request_id, [])
            self.pool.touch([b for b in blocks if b is not None])  # None: left the window
            self._tables[g][child.request_id] = list(blocks)
            self._ids[g][child.request_id] = list(self._ids[g].get(parent.request_id, []))
            if parent.request_id in self._dropped[g]:
                self._dropped[g][child.request_id] = self._dropped[g][parent.request_id]
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def held_blocks(self, request_id: str) -> Iterator[KVBlock]:
        """Every block the request holds, over all groups."""
        for table in self._tables:
            for b in table.get(request_id, ()):
                if b is not None:
                    yield b

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that the coming step fills, so requests admitted later in the same
        step already share them (store_kv runs before attention in every layer). Only the
        first group's blocks are announced in KV events: a router tracks one chain."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done = self._num_registered[rid]
        num_full = num_tokens // self.block_size
        if num_full <= done:
            return
        extend_block_hashes(self.hasher, request, self.block_size)
        hashes = request.block_hashes
        for g in range(1, self.num_groups):
            blocks = self._tables[g][rid]
            for i in range(done, num_full):
                block = blocks[i]
                if block is not None:
                    self.pool.cache(block, self._key(g, hashes[i]), announce=False)
        blocks = self.req_blocks[rid]
        events = self.pool.events
        run: BlockStored | None = None  # the event of the run of blocks stored just now
        for i in range(done, num_full):
            block = blocks[i]
            if block is None or not self.pool.cache(block, hashes[i]):
                run = None  # left the window, or already cached (elsewhere): breaks the run
                continue
            if events is None:
                continue
            tokens = request.tokens_slice(i * self.block_size, (i + 1) * self.block_size)
            if run is None:
                lora = request.lora_request
                run = BlockStored([], hashes[i - 1] if i else None, [], self.block_size,
                                  lora.lora_int_id if lora is not None else None)
                events.append(run)
            run.block_hashes.append(hashes[i])
            run.token_ids.extend(tokens)
        self._num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first, so a chain is evicted from
        its end.

        Blocks registered for tokens that were never computed (a step that failed, for example)
        lose their cache entry first: a later hit must never read K/V that was not written.
        Callers free before resetting `num_computed_tokens` (preemption does).
        """
        rid = request.request_id
        self._num_registered.pop(rid, None)
        if self.tier is not None:
            self.tier.swaps.forget(rid)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for g in range(self.num_groups):
            blocks = self._tables[g].pop(rid, None)
            self._ids[g].pop(rid, None)
            self._dropped[g].pop(rid, None)
            if not blocks:
                continue
            for block in blocks[first_uncomputed:]:
                if block is not None and block.block_hash is not None:
                    self.pool.uncache(block)
            self.pool.free(b for b in reversed(blocks) if b is not None)

    def free_lookahead(self, request: Request) -> int:
        """Return the blocks past the request's tokens (slots of rejected drafts) to the pool.
        They were allocated fresh for this request's lookahead and never cached: blocks are
        registered only up to the request's tokens, never a draft's."""
        keep = -(-request.num_tokens // self.block_size)
        freed = 0
        for g in range(self.num_groups):
            blocks = self._tables[g].get(request.request_id)
            if not blocks or len(blocks) <= keep:
                continue
            extra = blocks[keep:]
            del blocks[keep:]
            del self._ids[g][request.request_id][keep:]
            self.pool.free(b for b in reversed(extra) if b is not None)
            freed += len(extra)
        return freed

    def free_out_of_window(self, request: Request) -> int:
        """Release the request's leading blocks that a sliding group's window no longer
        reaches: the next token, at position `num_computed_tokens`, sees from
        `position - window + 1` on. Returns how many were released (0 without a window)."""
        rid = request.request_id
        freed = 0
        for g, window in enumerate(self.windows):
            blocks = self._tables[g].get(rid)
            if window is None or not blocks:
                continue
            first_needed = first_in_window(request.num_computed_tokens, window, self.block_size)
            first_needed = min(first_needed, len(blocks))
            done = self._dropped[g].get(rid, 0)
            if first_needed <= done:
                continue
            drop = [b for b in blocks[done:first_needed] if b is not None]
            for i in range(done, first_needed):
                blocks[i] = None
            self._dropped[g][rid] = first_needed
            self.pool.free(reversed(drop))  # tail first, as in `free`: evicted before the head
            freed += len(drop)
        self.num_window_freed += freed
        return freed

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in a group (the live list: read it, don't change it)."""
        return self._ids[group].get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """Length of the request's block tables (released leading entries included)."""
        return len(self.req_blocks.get(request_id, ()))

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request holds now in a group, or in all (less what left the window)."""
        if group is None:
            return sum(1 for _ in self.held_blocks(request_id))
        return sum(1 for b in self._tables[group].get(request_id, ()) if b is not None)

    def reset_counters(self) -> None:
        """Prefix-cache lookups counted from now (after the warm-up's)."""
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ---------------------------------------------------------------- accounting
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def stats(self) -> dict[str, int | float]:
        used = self.pool.num_used_blocks
        return (self.tier.swaps.stat_dict() if self.tier is not None else {}) | {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "kv_blocks_in_use": used,
            "kv_blocks_cached": self.pool.num_cached_blocks,
            "kv_usage": used / self.pool.num_blocks,
            "kv_slots_allocated": used * self.block_size,
            "kv_blocks_freed_out_of_window": self.num_window_freed,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "kv_blocks_shared": self.pool.num_shared_refs,
            "kv_cow_copies": self.num_cow_copies,
        }
