"""Random add / step / abort / finish / fork / prune operations on a scheduler over a small
pool, with a simulated KV store and the invariants checked after each: what the engine-core
property test (tests/test_engine_core_property.py) and its tier variant
(tests/test_kv_tier_property.py) both run, so the two drive the scheduler alike.

A simulated KV store records which token each slot holds (and applies the step's copy-on-write
copies), so a prefix hit, a forked block or a shared block written in place that pointed at the
wrong content would be caught, not only bookkeeping slips.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kserve_paged_engine.core.request import RequestStatus
from tests.helpers.core import apply_step, make_request

BS = 4
BUDGET = 48
MAX_SEQS = 6
OPS_PER_EXAMPLE = 200

PREFIXES = [[], list(range(500, 512)), list(range(600, 609)), list(range(500, 508))]

op_strategy = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1), st.integers(1, 30),
              st.integers(1, 25), st.sampled_from([None, "t1"]), st.integers(0, 3),
              st.booleans()),
    st.tuples(st.just("step"), st.integers(0, 2**31)),
    st.tuples(st.just("step"), st.integers(0, 2**31)),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("finish"), st.integers(0, 100)),
    st.tuples(st.just("fork"), st.integers(0, 100), st.integers(0, 40)),
    st.tuples(st.just("fork"), st.integers(0, 100), st.integers(0, 40)),
    st.tuples(st.just("prune"), st.integers(0, 100)),
)


def check_invariants(sched) -> None:
    """The pool's books against the requests' tables: every reference held once, free means
    unreferenced, no running request short of blocks for what it computed."""
    kv = sched.kv
    pool = kv.pool
    assert pool.num_shared_blocks == sum(1 for b in pool.blocks if b.ref_cnt > 1)
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_free_blocks
    holders = {i: 0 for i in range(pool.num_blocks)}
    for tables, id_tables in zip(kv._tables, kv._ids):  # every KV group's
        assert id_tables.keys() == tables.keys() == kv.req_blocks.keys()
        for rid, blocks in tables.items():
            ids = id_tables[rid]
            assert len(ids) == len(blocks) == kv.num_blocks_of(rid)
            assert [i for i, b in zip(ids, blocks) if b] == [b.block_id for b in blocks if b]
            for b in blocks:
                if b is not None:  # None: left the sliding window
                    holders[b.block_id] += 1
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
        assert (b.block_id in free_ids) == (b.ref_cnt == 0)
    assert pool.num_shared_refs == sum(max(b.ref_cnt - 1, 0) for b in pool.blocks)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for req in sched.running:
        assert kv.num_blocks_of(req.request_id) * BS >= req.num_computed_tokens
    for req in sched.waiting:
        assert kv.num_blocks_of(req.request_id) == 0 and req.num_computed_tokens == 0
    assert len(sched.running) <= MAX_SEQS


def run_step(sched, kv_store: dict[int, tuple[int, int]], seed: int) -> None:
    """One engine step on the simulated store: the copies, the new tokens' K/V written, every
    read checked against what its position holds, a token sampled where a chunk ends."""
    out = sched.schedule()
    for req, _ in out.unschedulable:  # what the engine does: the whole group fails
        sched.finish_requests([r.request_id for r in list(sched.waiting)
                               if r.fork_root == req.fork_root or r is req],
                              RequestStatus.FINISHED_ERROR)
    assert out.total_num_scheduled_tokens <= BUDGET
    assert len(out.scheduled) <= MAX_SEQS
    for src, dst in out.block_copies:  # copy-on-write, before the forward
        assert sched.kv.pool.blocks[dst].ref_cnt == 1
        for off in range(BS):
            if src * BS + off in kv_store:
                kv_store[dst * BS + off] = kv_store[src * BS + off]
    groups = list(enumerate(sched.kv.windows))  # each KV group writes and reads its blocks
    for req in out.scheduled:
        n = out.num_scheduled_tokens[req.request_id]
        assert n >= 1
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        assert end <= req.num_tokens
        for g, _ in groups:
            ids = sched.kv.block_ids(req.request_id, g)
            assert len(ids) * BS >= end
            for pos in range(start, end):  # store_kv of the new tokens
                kv_store[ids[pos // BS] * BS + pos % BS] = (req.token_at(pos), pos)
    for req in out.scheduled:  # attention reads every position up to the new ones (in window)
        n = out.num_scheduled_tokens[req.request_id]
        for g, window in groups:
            ids = sched.kv.block_ids(req.request_id, g)
            first = max(0, req.num_computed_tokens - window + 1) if window else 0
            for pos in range(first, req.num_computed_tokens + n):
                assert kv_store.get(ids[pos // BS] * BS + pos % BS) == (req.token_at(pos),
                                                                         pos), \
                    f"{req.request_id} reads wrong KV at position {pos} in group {g}"
    sampled = {}
    for i, req in enumerate(out.scheduled):
        n = out.num_scheduled_tokens[req.request_id]
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[req.request_id] = (seed >> (i % 24)) % 40 + 1  # token 2 is EOS
    apply_step(sched, out, sampled)


def add(sched, kv_store, counter, op) -> None:
    _, p, length, max_tokens, salt, prio, lockstep = op
    rid = f"r{next(counter)}"
    tokens = PREFIXES[p] + [1000 + (i * 7 + int(rid[1:])) % 50 for i in range(length)]
    req = make_request(rid, tokens, max_tokens=max_tokens, salt=salt, priority=prio,
                       ignore_eos=bool(prio % 2))
    # A beam-search root: its forks are admitted as a group (Scheduler._admit_forks).
    req.sampling_params.use_beam_search = lockstep
    try:
        sched.add_request(req)
    except ValueError:
        assert len(tokens) >= sched.max_model_len


def step(sched, kv_store, counter, op) -> None:
    run_step(sched, kv_store, op[1])


def abort(sched, kv_store, counter, op) -> None:
    ids = list(sched.requests)
    if ids:
        sched.abort(ids[op[1] % len(ids)])
    sched.abort("no-such-request")


def finish(sched, kv_store, counter, op) -> None:
    running = [r.request_id for r in sched.running]
    if running:
        sched.finish_requests([running[op[1] % len(running)]], RequestStatus.FINISHED_STOPPED)


def fork(sched, kv_store, counter, op) -> None:
    """A copy of a running request; if the parent has a token not yet computed, the child's
    differs, so both write different K/V into the same shared position."""
    running = [r for r in sched.running if r.num_computed_tokens]
    if running and len(sched.running) < MAX_SEQS:
        parent = running[op[1] % len(running)]
        child = sched.fork(parent, f"r{next(counter)}")
        if child.num_computed_tokens < child.num_tokens and child.output_token_ids:
            child.output_token_ids[-1] = 1000 + op[2]


def prune(sched, kv_store, counter, op) -> None:
    """A forked member of a group ends; the others keep its blocks."""
    grouped = [r for r in sched.running if r.fork_root is not None]
    if grouped:
        sched.finish_requests([grouped[op[1] % len(grouped)].request_id],
                              RequestStatus.FINISHED_STOPPED)


OPERATIONS = {"add": add, "step": step, "abort": abort, "finish": finish, "fork": fork,
              "prune": prune}
