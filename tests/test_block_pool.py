"""The block pool: free-queue order, O(1) removal, ref counts, eviction of cached blocks."""

import pytest

from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock

hash_block = BlockHasher()  # keys as the KV manager makes them (tests/test_block_hash.py)


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert len(q) == 4
    with pytest.raises(RuntimeError):
        q.remove(KVBlock(99))


def test_allocate_evicts_cached_block_and_counts_refs():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = hash_block(None, [1, 2, 3])
    pool.cache(a, h)
    pool.free([a, b])
    assert pool.num_free_blocks == 3
    # b holds nothing, so it went to the head; block 2 was never used; a, which holds a cached
    # prefix, went to the tail and is evicted last, losing its key.
    assert pool.allocate(1)[0] is b
    assert pool.allocate(1)[0].block_id == 2
    assert pool.lookup(h) is a
    assert pool.allocate(1)[0] is a
    assert pool.lookup(h) is None and a.block_hash is None


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_plain_freed_blocks_are_reused_before_any_cached_prefix_is_evicted():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    h = hash_block(None, [1])
    pool.cache(a, h)
    pool.free([a])  # holds a cached prefix: tail
    pool.free([b])  # holds nothing: head, reused first (its memory is warm)
    assert [x.block_id for x in pool.free_queue] == [b.block_id, a.block_id]
    assert pool.allocate(1) == [b]
    assert pool.lookup(h) is a  # the cached prefix survived
    pool.free([c, d])
    assert [x.block_id for x in pool.allocate(2)] == [d.block_id, c.block_id]
    assert pool.lookup(h) is a
    assert pool.allocate(1) == [a] and pool.lookup(h) is None  # evicted only when nothing else
