"""Forks and copy-on-write in the KV-cache manager and the scheduler (docs/engine.md)."""

import zlib

import pytest
import torch

from kserve_paged_engine.core.request import RequestStatus
from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.block_copy import copy_blocks, copy_blocks_ref
from tests.helpers.core import apply_step, fake_step, make_request, make_scheduler

BS = 16


def step(sched, token=7):
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out, token=token))
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
    assert child.fork_root == parent.fork_root == "p"
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_copy_blocks_matches_the_block_by_block_reference(dtype, path, monkeypatch):
    if path == "native" and cpu_native.load() is None:
        pytest.skip("the native library cannot be built here (no C compiler)")
    if path == "torch":  # what runs on CUDA, or without the library
        monkeypatch.setattr(cpu_native, "copy_blocks", lambda *a: None)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 10, 4, 2, 8, generator=g).to(dtype) for _ in range(3)]
    expect = [c.clone() for c in caches]
    copy_blocks(caches, torch.tensor([1, 7, 3]), torch.tensor([2, 0, 9]))
    copy_blocks_ref(expect, [1, 7, 3], [2, 0, 9])
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
    assert torch.equal(caches[0][:, 2], caches[0][:, 1]) and not torch.equal(caches[0][:, 2],
                                                                             caches[0][:, 3])


def test_the_native_block_copy_refuses_a_block_past_the_cache_and_copies_nothing():
    if cpu_native.load() is None:
        pytest.skip("the native library cannot be built here (no C compiler)")
    caches = [torch.randn(2, 4, 2, 8) for _ in range(2)]
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match="outside the cache of 4 blocks"):
        cpu_native.copy_blocks(caches, torch.tensor([0, 1]), torch.tensor([2, 4]))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
    # Caches it cannot take (not contiguous) are left to the torch path: None, nothing done.
    assert cpu_native.copy_blocks([c.transpose(2, 3) for c in caches], torch.tensor([0]),
                                  torch.tensor([1])) is None



def step_own(sched):
    """A step in which each request samples a token of its own (forks diverge)."""
    out = sched.schedule()
    sampled = {rid: 3 + zlib.crc32(rid.encode()) % 40 for rid in fake_step(sched, out)}
    apply_step(sched, out, sampled)
    return out


def preempt_all(sched, members):
    """Preempt the group by hand, as the scheduler does (free before resetting)."""
    for m in members:
        sched.running.remove(m)
        sched.kv.free(m)
        m.num_computed_tokens = 0
        m.status = RequestStatus.PREEMPTED
        sched.waiting.push(m)


def test_a_preempted_group_shares_its_common_blocks_again_with_prefix_caching_off():
    """Re-admitted after a preemption, forks take the blocks of their common tokens from a
    running sibling (sibling hits), so the group holds its history once again."""
    sched = make_scheduler(num_blocks=64, caching=False)
    kv = sched.kv
    root = make_request("g", 5 * BS + 3, max_tokens=200)
    sched.add_request(root)
    step_own(sched)  # 84 tokens: the prompt and a first token, shared by every fork
    members = [root] + [sched.fork(root, f"g.{i}") for i in range(1, 4)]
    for _ in range(3):
        step_own(sched)
    held_before = kv.pool.num_used_blocks
    lengths = {m.request_id: m.num_tokens for m in members}
    preempt_all(sched, members)
    assert kv.pool.num_used_blocks == 0
    out = step_own(sched)
    assert {r.request_id for r in sched.running} == set(lengths)
    # The first recomputes everything; the others only past their 5 shared full blocks.
    assert out.num_scheduled_tokens["g"] == lengths["g"]
    for rid in ("g.1", "g.2", "g.3"):
        assert out.num_scheduled_tokens[rid] == lengths[rid] - 5 * BS
        assert kv.block_ids(rid)[:5] == kv.block_ids("g")[:5]
    assert kv.pool.num_used_blocks <= held_before + 4  # each may add its next-token block
    while sched.has_unfinished():
        step_own(sched)
    assert kv.pool.num_free_blocks == 64


def test_a_following_beam_waits_for_the_shared_tokens_instead_of_computing_them_twice():
    """Chunked prefill: a re-admitted beam whose common prefix the beam ahead of it has not
    written yet computes nothing until it has, then takes those blocks."""
    sched = make_scheduler(num_blocks=64, caching=False, budget=2 * BS)
    kv = sched.kv
    root = make_request("g", 4 * BS, max_tokens=100)
    root.sampling_params.use_beam_search = True  # admitted as a group (Scheduler._admit_forks)
    sched.add_request(root)
    while not root.output_token_ids:
        step_own(sched)
    child = sched.fork(root, "g.1")
    step_own(sched)  # both decode: 66 tokens each, 65 shared
    preempt_all(sched, [root, child])
    out = step_own(sched)  # both admitted; the first computes 32, the second takes 2 blocks
    assert out.num_scheduled_tokens == {"g": 32}
    assert child.status is RequestStatus.RUNNING and child.num_computed_tokens == 32
    out = step_own(sched)
    assert out.num_scheduled_tokens == {"g": 32}  # the follower waits
    out = step_own(sched)
    assert out.num_scheduled_tokens == {"g": 2, "g.1": 2}
    assert kv.block_ids("g.1")[:4] == kv.block_ids("g")[:4]  # the prompt's blocks, once
    assert kv.pool.num_used_blocks == 6  # 4 shared prompt blocks, one of its own each
