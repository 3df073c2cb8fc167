"""The scheduler's only door to KV memory: prefix lookup, all-or-nothing allocation, free."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock, hash_block
from engine.request import Request


@dataclass(slots=True)
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int


NO_HIT = PrefixHit([], 0)


def _first_block_extra(request: Request) -> bytes | None:
    """What besides tokens keys the first block (so the whole chain): the cache salt and the
    adapter, so a prefix never hits across salts or LoRA adapters."""
    parts = []
    if request.cache_salt:
        parts.append(request.cache_salt.encode())
    if request.lora_request is not None:
        parts.append(b"\0lora:%d" % request.lora_request.lora_int_id)
    return b"".join(parts) or None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as plain ids, grown alongside: the runner reads them every step.
        self.req_block_ids: dict[str, list[int]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Prefix-cache accounting, in tokens (what vLLM's metrics count).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---------------------------------------------------------------- hashing
    def _extend_block_hashes(self, request: Request) -> None:
        """Grow the request's chain of full-block hashes to cover its known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = _first_block_extra(request) if i == 0 else None
            hashes.append(hash_block(parent, request.tokens_slice(i * bs, (i + 1) * bs), extra))

    # ---------------------------------------------------------------- API
    def find_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks matching the request's leading tokens.

        The hit stops short of the last token, whose logits must be computed, and is counted in
        the prefix-cache metrics only when the request is admitted (see `record_lookup`).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT  # prompt logprobs need logits at every prompt position
        self._extend_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def record_lookup(self, request: Request, hit: PrefixHit) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit = NO_HIT) -> bool:
        """Make room for `num_new_tokens` after the request's computed (and hit) tokens.

        All or nothing: on failure no ref count, free-queue position or cache entry changes.
        """
        held = self.req_blocks.get(request.request_id)
        total = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        need = self.blocks_needed(request, num_new_tokens, hit)
        if need > self.pool.num_free_blocks:
            return False
        if held is None:
            held = self.req_blocks[request.request_id] = []
            self.req_block_ids[request.request_id] = []
            self._num_registered[request.request_id] = 0
        ids = self.req_block_ids[request.request_id]
        if hit.blocks:
            self.pool.touch(hit.blocks)
            held.extend(hit.blocks)
            ids.extend(b.block_id for b in hit.blocks)
            self._num_registered[request.request_id] = len(held)
        num_new_blocks = -(-total // self.block_size) - len(held)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            held.extend(new)
            ids.extend(b.block_id for b in new)
        self._register_full_blocks(request, min(total, request.num_tokens))
        return True

    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Free blocks an allocation would consume: new blocks plus hit blocks that are free
        (taking those out of the free queue uses them up as room for new blocks)."""
        held = self.req_blocks.get(request.request_id)
        total = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        new = -(-total // self.block_size) - (len(held) if held else 0) - len(hit.blocks)
        return max(new, 0) + sum(1 for b in hit.blocks if b.ref_cnt == 0)

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks only this request holds: what freeing it returns to the free queue."""
        return sum(1 for b in self.req_blocks.get(request_id, ()) if b.ref_cnt == 1)

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that the coming step fills, so requests admitted later in the same
        step already share them (store_kv runs before attention in every layer)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done = self._num_registered[rid]
        num_full = num_tokens // self.block_size
        if num_full <= done:
            return
        self._extend_block_hashes(request)
        blocks = self.req_blocks[rid]
        for i in range(done, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a chain is evicted from its end.

        Blocks registered for tokens that were never computed (a step that failed, for example)
        lose their cache entry first: a later hit must never read K/V that was not written.
        Callers free before resetting `num_computed_tokens` (preemption does).
        """
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_block_ids.pop(rid, None)
        self._num_registered.pop(rid, None)
        if not blocks:
            return
        first_uncomputed = request.num_computed_tokens // self.block_size
        for block in blocks[first_uncomputed:]:
            if block.block_hash is not None:
                self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read it, don't change it)."""
        return self.req_block_ids.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

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
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "kv_blocks_in_use": used,
            "kv_blocks_cached": self.pool.num_cached_blocks,
            "kv_usage": used / self.pool.num_blocks,
            "kv_slots_allocated": used * self.block_size,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
        }
