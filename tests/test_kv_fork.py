"""Forks and copy-on-write in the KV-cache manager and the scheduler (docs/engine.md)."""

import torch

from engine.request import RequestStatus
from kernels.block_copy import copy_blocks, copy_blocks_ref
from tests.core_helpers import fake_step, make_request, make_scheduler

BS = 16


def step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, fake_step(sched, out, token=token))
    return out


def test_a_fork_shares_every_block_and_the_first_write_copies_the_partial_one():
    sched = make_scheduler()
    kv = sched.kv
    parent = make_request("p", 2 * BS + 5, max_tokens=50)
    sched.add_request(parent)
    step(sched)  # prompt computed, one token sampled (not yet computed)
    used = kv.pool.num_used_blocks
    child = sched.fork(parent, "c")
    assert kv.block_ids("c") == kv.block_ids("p")
    assert [b.ref_cnt for b in kv.req_blocks["p"]] == [2, 2, 2]
    assert kv.pool.num_used_blocks == used and kv.stats()["kv_blocks_shared"] == 3
    assert child.group_id == parent.group_id == "p"
    out = step(sched)
    # Both write position 37 of the shared partial block: the first copies, the second owns it.
    assert len(out.block_copies) == 1
    src, dst = out.block_copies[0]
    assert kv.block_ids("p")[:2] == kv.block_ids("c")[:2]
    assert {kv.block_ids("p")[2], kv.block_ids("c")[2]} == {src, dst}
    assert kv.num_cow_copies == 1 and kv.stats()["kv_blocks_shared"] == 2
    assert kv.pool.num_used_blocks == used + 1


def test_freeing_a_pruned_fork_returns_only_the_blocks_no_one_else_holds():
    sched = make_scheduler()
    kv = sched.kv
    parent = make_request("p", 3 * BS + 1, max_tokens=50)
    sched.add_request(parent)
    step(sched)
    sched.fork(parent, "c")
    step(sched)  # each now owns its copy of block 3
    free = kv.num_free_blocks
    sched.finish_requests(["c"], RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == free + 1
    assert all(b.ref_cnt == 1 for b in kv.req_blocks["p"])
    sched.finish_requests(["p"], RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == kv.num_blocks and kv.stats()["kv_blocks_shared"] == 0


def test_copy_on_write_blocks_count_in_the_allocation_budget():
    sched = make_scheduler(num_blocks=4)
    kv = sched.kv
    parent = make_request("p", 3 * BS + 1, max_tokens=50)
    sched.add_request(parent)
    step(sched)  # 4 blocks held, none free
    child = sched.fork(parent, "c")
    assert kv.blocks_needed(child, 1) == 1 and kv.blocks_needed(parent, 1) == 1
    assert not kv.allocate_slots(child, 1)  # no free block for the copy: nothing changes
    assert kv.take_block_copies() == [] and [b.ref_cnt for b in kv.req_blocks["c"]] == [2] * 4


def test_preempting_one_member_of_a_group_preempts_the_group():
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", 2 * BS + 2, max_tokens=200)
    sched.add_request(a)
    step(sched)
    sched.fork(a, "a2")
    b = make_request("b", BS + 2, max_tokens=200)
    sched.add_request(b)
    preempted = []
    for _ in range(40):
        preempted += step(sched).preempted
        if preempted:
            break
    assert preempted == ["b"]  # b arrived last: the victim; a and its fork keep running
    # Now a's group is the worse one (it arrived after c): both members go, none is split off.
    sched2 = make_scheduler(num_blocks=8)
    c = make_request("c", BS + 2, max_tokens=200, arrival=0.0)
    sched2.add_request(c)
    a = make_request("a", 2 * BS + 2, max_tokens=200, arrival=1.0)
    sched2.add_request(a)
    step(sched2)
    sched2.fork(a, "a2")
    preempted = []
    for _ in range(60):
        preempted += step(sched2).preempted
        if preempted:
            break
    assert sorted(preempted) == ["a", "a2"]
    assert sched2.kv.num_blocks_of("a") == sched2.kv.num_blocks_of("a2") == 0
    while sched2.has_unfinished():
        step(sched2)
    assert sched2.kv.num_free_blocks == 8


def test_copy_blocks_matches_the_block_by_block_reference():
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 10, 4, 2, 8, generator=g) for _ in range(3)]
    expect = [c.clone() for c in caches]
    copy_blocks(caches, torch.tensor([1, 7, 3]), torch.tensor([2, 0, 9]))
    copy_blocks_ref(expect, [1, 7, 3], [2, 0, 9])
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
    assert torch.equal(caches[0][:, 2], caches[0][:, 1]) and not torch.equal(caches[0][:, 2],
                                                                             caches[0][:, 3])
