"""KV groups (engine/kserve_paged_engine/core/kv_groups.py): global and sliding-window layers with their own block tables
from one pool; the block accounting of a Gemma-style model serving requests past its window."""

from __future__ import annotations

from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.kv_groups import kv_layout
from kserve_paged_engine.core.preemption import num_reclaimable
from kserve_paged_engine.core.scheduler import Scheduler
from tests.helpers.core import apply_step, fake_step, make_request

GEMMA3 = ([512] * 5 + [None]) * 2  # 5 local : 1 global, 12 layers


def _scheduler(windows: list[int | None], num_blocks: int, bs: int, budget: int,
               per_group: bool = True, caching: bool = True) -> Scheduler:
    layout = kv_layout(windows, per_group)
    kv = KVCacheManager(num_blocks, bs, caching, group_windows=layout.group_windows)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, 8192)


def test_layers_are_grouped_by_type_in_groups_of_equal_size() -> None:
    layout = kv_layout(GEMMA3)
    assert layout.group_size == 2 and layout.group_windows == [None] + [512] * 5
    assert [layout.layer_group[i] for i in (5, 11)] == [0, 0]  # the global layers together
    assert sorted(zip(layout.layer_group, layout.layer_slot)) == [
        (g, s) for g in range(6) for s in range(2)]  # every (group, slot) names one layer
    gemma2 = kv_layout([4096, None] * 13)
    assert gemma2.group_windows == [None, 4096] and gemma2.group_size == 13
    # Gemma-3-270M: 18 layers, 3 global: six groups of three.
    assert kv_layout(([512] * 5 + [None]) * 3).group_windows == [None] + [512] * 5
    # One type, one group of every layer (Llama; Mistral slides in its one group).
    assert kv_layout([None] * 4).group_windows == [None]
    assert kv_layout([8] * 4).group_windows == [8] and kv_layout([8] * 4).group_size == 4
    # A count the smallest does not divide: the last group has an unused slot.
    odd = kv_layout([None, None, 8, 8, 8])
    assert odd.group_windows == [None, 8, 8] and odd.layer_slot == [0, 1, 0, 1, 0]
    assert kv_layout(GEMMA3, per_group=False).group_windows == [None]


def test_window_512_serving_4k_requests_holds_the_window_per_sliding_group() -> None:
    """The issue's accounting: a Gemma-style model (window 512, 5 local : 1 global) serving
    4k-token prompts in 512-token chunks. Between steps every sliding group of every request
    holds at most the window's blocks (plus the one the window starts in); inside a step at
    most the window before its chunk plus the chunk; the global group holds every token. All
    blocks come back, and the same load with one shared table holds every token in every
    layer."""
    bs, window, chunk = 16, 512, 512
    sched = _scheduler(GEMMA3, num_blocks=4000, bs=bs, budget=chunk)
    kv = sched.kv
    prompts = [make_request(f"r{i}", 4096, max_tokens=40) for i in range(3)]
    for r in prompts:
        sched.add_request(r)
    window_blocks = -(-window // bs) + 1
    step_blocks = -(-(window - 1 + chunk) // bs) + 1
    peak_sliding = peak_layer_blocks = 0
    while sched.has_unfinished():
        out = sched.schedule()
        for r in out.scheduled:
            for g in range(1, kv.num_groups):
                held = kv.num_held_blocks(r.request_id, g)
                assert held <= step_blocks
                peak_sliding = max(peak_sliding, held)
        # Layer-blocks held at once (a block holds group_size = 2 layers).
        peak_layer_blocks = max(peak_layer_blocks, kv.pool.num_used_blocks * 2)
        apply_step(sched, out, fake_step(sched, out))
        for r in sched.running:
            n = r.num_computed_tokens
            assert kv.num_held_blocks(r.request_id, 0) == -(-n // bs)
            for g in range(1, kv.num_groups):
                assert kv.num_held_blocks(r.request_id, g) <= min(window_blocks, -(-n // bs))
    assert peak_sliding > window_blocks  # a 512-token chunk on top of a 512-token window
    assert kv.num_window_freed > 0
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)

    shared = _scheduler(GEMMA3, num_blocks=2000, bs=bs, budget=chunk, per_group=False)
    for i in range(3):
        shared.add_request(make_request(f"r{i}", 4096, max_tokens=40))
    peak_shared = 0
    while shared.has_unfinished():
        out = shared.schedule()
        peak_shared = max(peak_shared, shared.kv.pool.num_used_blocks * 12)
        apply_step(shared, out, fake_step(shared, out))
    assert shared.kv.num_window_freed == 0
    # Requests of up to 259 blocks each (4136 tokens): in all 12 layers with one table,
    # against 2 global layers of 259 and 10 sliding layers of at most `step_blocks`.
    assert peak_layer_blocks <= 3 * (259 * 2 + step_blocks * 10)
    assert peak_shared > 2 * 256 * 12  # two whole prompts at least, in every layer
    assert peak_layer_blocks < peak_shared / 2, (peak_layer_blocks, peak_shared)


def _run_prompt(sched: Scheduler, rid: str, tokens: list[int]) -> None:
    sched.add_request(make_request(rid, tokens, max_tokens=1))
    while sched.has_unfinished():
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out))


def test_a_prefix_hit_needs_each_sliding_groups_window_before_its_end() -> None:
    """A hit takes the global group's blocks from block 0 and a sliding group's only for the
    window before the hit's end (None before it); a window block gone from the cache cuts the
    hit back to before it."""
    bs, window = 4, 8
    sched = _scheduler([window, None], num_blocks=64, bs=bs, budget=64)
    kv = sched.kv
    tokens = list(range(3, 43))  # 40 tokens: 10 blocks
    _run_prompt(sched, "a", tokens)
    again = make_request("b", tokens + [99, 98])
    hit = kv.find_prefix(again)
    assert hit.num_tokens == 40  # every block of the prompt, both groups cached
    first = (40 - window + 1) // bs  # the first block the next token's window reaches
    assert len(hit.groups[0]) == 10 and all(b is not None for b in hit.groups[0])
    assert hit.groups[1][:first] == [None] * first
    assert all(b is not None for b in hit.groups[1][first:])
    # Evict the sliding group's block 8 (tokens 32-35): a hit ending at 40 or 36 would need
    # it, so the hit ends at block 8 (32 tokens), whose window (blocks 6-7) is still cached.
    victim = hit.groups[1][8]
    kv.pool.uncache(victim)
    hit = kv.find_prefix(again)
    assert hit.num_tokens == 32
    assert [b is None for b in hit.groups[1]] == [True] * 6 + [False] * 2
    # Admitted with it: the hit's tokens count as computed, the greedy tokens follow.
    sched.add_request(again)
    out = sched.schedule()
    assert again.num_computed_tokens == 32 and out.num_scheduled_tokens["b"] == 10
    apply_step(sched, out, fake_step(sched, out))
    while sched.has_unfinished():
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out))
    assert kv.num_free_blocks == kv.num_blocks


def test_forks_share_every_groups_blocks_and_copy_on_write_in_each() -> None:
    """A fork shares both groups' tables; the partial last block is copied in each group when
    both write into it; lookahead blocks are trimmed in every group; all blocks come back."""
    bs = 4
    sched = _scheduler([8, None], num_blocks=64, bs=bs, budget=64, caching=False)
    kv = sched.kv
    parent = make_request("p", list(range(3, 21)), max_tokens=4)  # 18 tokens: a partial block
    sched.add_request(parent)
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out))
    child = sched.fork(parent, "c")
    for g in range(2):
        assert kv.block_ids("c", g) == kv.block_ids("p", g)
    assert num_reclaimable(kv, ["p"]) == 0  # every block is the child's too
    out = sched.schedule()
    assert len(out.block_copies) == 2  # the shared partial block, once per group
    apply_step(sched, out, fake_step(sched, out))
    for g in range(2):
        assert kv.block_ids("c", g)[-1] != kv.block_ids("p", g)[-1]
    assert kv.num_held_blocks("p", 1) <= 8 // bs + 1  # the window's blocks
    held = kv.num_held_blocks("c")
    kv.allocate_slots(child, 9)  # a lookahead of 9 slots: 2 more blocks per group
    assert kv.num_held_blocks("c") == held + 4
    assert kv.free_lookahead(child) == 4 and kv.num_held_blocks("c") == held
    while sched.has_unfinished():
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out))
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_hit_in_a_later_group_is_never_allocated_to_an_earlier_one() -> None:
    """Free cached blocks of a sliding group's hit sit in the free queue behind other free
    blocks; the global group's new blocks must not be popped from under the hit (found by
    tests/test_engine_core_property.py: one block in two groups' tables, its K/V overwritten)."""
    kv = KVCacheManager(14, 4, True, group_windows=[None, 9])

    def computed(rid: str, tokens: list[int]):
        req = make_request(rid, tokens)
        assert kv.allocate_slots(req, len(tokens))
        req.num_computed_tokens = len(tokens)
        return req

    a1 = computed("a1", list(range(1, 10)))  # 2 full blocks cached per group, 1 partial
    a2 = computed("a2", list(range(100, 108)))  # full blocks only: freed to the queue's tail
    a3 = computed("a3", list(range(200, 208)))
    for req in (a1, a2, a3):
        kv.free(req)
    b = make_request("b", list(range(1, 9)) + list(range(300, 320)))  # a1's prefix, 28 tokens
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8 and all(hit.groups[1])
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    ids = [kv.block_ids("b", g) for g in range(2)]
    assert not set(ids[0]) & set(ids[1])
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids[0] + ids[1])
