"""The block and prefix-cache behaviours of docs/engine.md, one named test each (8's output half is in test_llm)."""

import random

from kserve_paged_engine.core.request import RequestStatus
from tests.helpers.core import (
    apply_step,
    fake_step,
    make_request,
    make_scheduler,
    run_to_completion,
)

BS = 16


def admit(sched, req):
    """Add one request and run one (simulated) step; return its scheduled token count."""
    sched.add_request(req)
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out))
    return out.num_scheduled_tokens.get(req.request_id, 0), out


def test_1_partial_last_block_is_never_cached_or_shared():
    sched = make_scheduler()
    kv = sched.kv
    prompt = list(range(1000, 1000 + 2 * BS + 5))  # two full blocks and a partial one
    n, out = admit(sched, make_request("a", prompt))
    assert n == len(prompt)
    assert kv.pool.num_cached_blocks == 2
    partial = kv.req_blocks["a"][2]
    assert partial.block_hash is None
    b = make_request("b", prompt)
    n_b, _ = admit(sched, b)
    assert b.num_cached_tokens == 2 * BS and n_b == 5
    assert kv.req_blocks["b"][:2] == kv.req_blocks["a"][:2]
    assert kv.req_blocks["b"][2] is not partial


def test_2_same_prefix_shares_physical_blocks_and_allocates_only_its_tail():
    sched = make_scheduler()
    kv = sched.kv
    prefix = list(range(500, 500 + 3 * BS))
    admit(sched, make_request("a", prefix + [1, 2, 3]))
    free_before = kv.num_free_blocks
    b = make_request("b", prefix + [9, 9, 9, 9])
    n_b, _ = admit(sched, b)
    a_blocks, b_blocks = kv.req_blocks["a"], kv.req_blocks["b"]
    assert [x.block_id for x in b_blocks[:3]] == [x.block_id for x in a_blocks[:3]]
    assert all(x.ref_cnt == 2 for x in b_blocks[:3])
    assert b_blocks[3].ref_cnt == 1 and b_blocks[3] is not a_blocks[3]
    assert free_before - kv.num_free_blocks == 1
    assert n_b == 4 and b.num_cached_tokens == 3 * BS


def test_3_full_hit_still_recomputes_the_last_prompt_token():
    sched = make_scheduler()
    prompt = list(range(700, 700 + 4 * BS))  # exactly four full blocks
    admit(sched, make_request("a", prompt))
    b = make_request("b", prompt)
    n_b, _ = admit(sched, b)
    # Capped at len(prompt) - 1, rounded down to whole blocks: 3 blocks hit, 16 tokens to run.
    assert b.num_cached_tokens == 3 * BS
    assert n_b == BS
    assert sched.kv.prefix_cache_hits == 3 * BS
    assert sched.kv.prefix_cache_queries == 2 * 4 * BS


def test_4_hit_on_freed_cached_block_takes_it_back_from_the_free_queue():
    sched = make_scheduler(num_blocks=8)
    kv = sched.kv
    prompt = list(range(300, 300 + 4 * BS + 1))  # 5 blocks: 4 full + 1 partial
    req_a = make_request("a", prompt)
    admit(sched, req_a)
    a_ids = kv.block_ids("a")
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 8
    # Cached blocks are free but findable; a hit pulls them out of the middle of the queue.
    b = make_request("b", prompt[:4 * BS] + [1] * 40)  # needs 4 hit + 3 new = 7 blocks of 8
    n_b, _ = admit(sched, b)
    assert kv.block_ids("b")[:4] == a_ids[:4]
    assert b.num_cached_tokens == 4 * BS and n_b == 40
    # The 3 new blocks came from the 4 blocks that were not hit: none of the reused ones.
    assert set(kv.block_ids("b")[4:]).isdisjoint(a_ids[:4])
    assert kv.num_free_blocks == 1


def test_4b_a_request_never_evicts_the_blocks_it_is_about_to_reuse():
    # 6 blocks; 4 cached-and-free blocks; b needs 4 hits + 2 new: only 2 other free blocks.
    sched = make_scheduler(num_blocks=6)
    kv = sched.kv
    prompt = list(range(10, 10 + 4 * BS + 1))
    admit(sched, make_request("a", prompt))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    b = make_request("b", prompt[:4 * BS] + [3] * 20)
    n_b, _ = admit(sched, b)
    assert b.num_cached_tokens == 4 * BS and n_b == 20
    assert len(set(kv.block_ids("b"))) == 6
    # and one more token than fits is refused with nothing changed
    c = make_request("c", prompt[:4 * BS] + [4] * 17)
    n_c, _ = admit(sched, c)
    assert n_c == 0 and c.status is RequestStatus.WAITING


def test_5_eviction_is_least_recently_freed_and_tail_first():
    sched = make_scheduler(num_blocks=8)
    kv = sched.kv
    admit(sched, make_request("a", list(range(0, 3 * BS))))   # 3 blocks
    admit(sched, make_request("b", list(range(50, 50 + 3 * BS))))  # 3 blocks
    a_ids, b_ids = kv.block_ids("a"), kv.block_ids("b")
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    order = [blk.block_id for blk in kv.pool.free_queue]
    never_used = [i for i in range(8) if i not in a_ids + b_ids]
    # Freed blocks holding nothing (a's partial last block) go to the head, cached ones to the
    # tail in the order freed, each request's tail first.
    plain = [i for i in a_ids + b_ids if kv.pool.blocks[i].block_hash is None]
    cached_a = [i for i in a_ids[::-1] if i not in plain]
    cached_b = [i for i in b_ids[::-1] if i not in plain]
    assert plain and order == plain[::-1] + never_used + cached_a + cached_b
    # Allocating 4 takes what holds nothing, then evicts a's tail block first: a's head survives.
    c = make_request("c", list(range(900, 900 + 4 * BS - 1)))
    admit(sched, c)
    assert kv.block_ids("c") == (plain[::-1] + never_used + cached_a)[:4]
    assert kv.pool.blocks[a_ids[0]].block_hash is not None
    assert all(kv.pool.blocks[i].block_hash is not None for i in b_ids)


def test_6_failed_allocation_changes_no_ref_count_and_no_cache_entry():
    sched = make_scheduler(num_blocks=6)
    kv = sched.kv
    prompt = list(range(40, 40 + 2 * BS + 1))
    admit(sched, make_request("a", prompt))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    before = [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks]
    free_order = [b.block_id for b in kv.pool.free_queue]
    cached = dict(kv.pool.cached)
    big = make_request("big", prompt[:2 * BS] + [5] * (6 * BS))  # hits 2, needs 6 more: 8 > 6
    hit = kv.find_prefix(big)
    assert len(hit.blocks) == 2
    assert kv.allocate_slots(big, 6 * BS, hit) is False
    assert [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks] == before
    assert [b.block_id for b in kv.pool.free_queue] == free_order
    assert kv.pool.cached == cached
    assert "big" not in kv.req_blocks


def test_7_cache_salt_isolates_tenants():
    sched = make_scheduler()
    kv = sched.kv
    prompt = list(range(60, 60 + 3 * BS))
    admit(sched, make_request("a", prompt, salt="tenant-1"))
    b = make_request("b", prompt, salt="tenant-2")
    admit(sched, b)
    assert b.num_cached_tokens == 0
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))
    c = make_request("c", prompt, salt="tenant-1")
    admit(sched, c)
    assert c.num_cached_tokens == 2 * BS
    d = make_request("d", prompt)  # no salt is a tenant of its own too
    admit(sched, d)
    assert d.num_cached_tokens == 0


def test_8_with_prefix_caching_off_nothing_is_shared():
    sched = make_scheduler(caching=False)
    kv = sched.kv
    prompt = list(range(80, 80 + 3 * BS))
    admit(sched, make_request("a", prompt))
    b = make_request("b", prompt)
    n_b, _ = admit(sched, b)
    assert n_b == len(prompt) and b.num_cached_tokens == 0
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_9_reset_prefix_cache_refused_while_in_use_then_clears_every_key():
    sched = make_scheduler()
    kv = sched.kv
    admit(sched, make_request("a", list(range(3 * BS))))
    assert kv.pool.num_cached_blocks == 3
    assert kv.reset_prefix_cache() is False
    assert kv.pool.num_cached_blocks == 3
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in kv.pool.blocks)
    b = make_request("b", list(range(3 * BS)))
    admit(sched, b)
    assert b.num_cached_tokens == 0


def test_10_no_leak_after_add_step_abort_finish_preempt():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, budget=64)
    kv = sched.kv
    for i in range(10):
        sched.add_request(make_request(f"r{i}", rng.randrange(5, 60), max_tokens=rng.randrange(1, 40)))
    for step in range(40):
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out, rng))
        if step == 5:
            sched.abort("r3")
            sched.abort("does-not-exist")  # a no-op
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_blocks


def test_11_blocks_out_of_every_layers_window_are_freed_while_running():
    """Window 32, blocks of 4, a 200-token prompt in chunks of 16, then 40 decodes: the request
    never holds more than the window's blocks plus those of the chunk it is computing, the rest
    go back to the pool as they fall out; a second request with the same prompt still hits the
    cache from block 0 while those blocks are free, and once all ends nothing is held."""
    window, bs, chunk = 32, 4, 16
    sched = make_scheduler(num_blocks=64, block_size=bs, budget=chunk, sliding_window=window)
    kv = sched.kv
    prompt = list(range(100, 300))
    sched.add_request(make_request("a", prompt, max_tokens=40))
    peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        held = kv.num_held_blocks("a")
        peak = max(peak, held)
        assert held <= -(-(window + chunk) // bs) + 1, (held, out.num_scheduled_tokens)
        assert kv.num_free_blocks == kv.num_blocks - held
        apply_step(sched, out, fake_step(sched, out))
    assert peak < -(-len(prompt) // bs)  # far below the 50 blocks the prompt alone fills
    stats = kv.stats()
    assert stats["kv_blocks_freed_out_of_window"] > 40 and stats["kv_blocks_in_use"] == 0
    # The freed full blocks stayed cached: the same prompt hits all of them.
    b = make_request("b", prompt, max_tokens=1)
    admit(sched, b)
    assert b.num_cached_tokens == (len(prompt) - 1) // bs * bs
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_11_window_freeing_with_preemption_leaks_nothing():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=14, block_size=4, budget=24, sliding_window=12)
    kv = sched.kv
    for i in range(8):
        sched.add_request(make_request(f"w{i}", rng.randrange(10, 60),
                                       max_tokens=rng.randrange(5, 40)))
    run_to_completion(sched)
    assert sched.num_preemptions > 0 and kv.num_window_freed > 0
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
