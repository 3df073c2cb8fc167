"""Random add / step / abort / finish / fork / prune sequences against a small pool, checked
after every step (the operations and the simulated KV store: tests/helpers/core_random_ops.py),
with a router's index rebuilt from the pool's KV-cache events alongside.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kserve_paged_engine.core.kv_events import BlockRemoved, BlockStored
from tests.helpers.core import make_scheduler
from tests.helpers.core_random_ops import (
    BS,
    BUDGET,
    MAX_SEQS,
    OPERATIONS,
    OPS_PER_EXAMPLE,
    check_invariants,
    op_strategy,
)

NUM_BLOCKS = 24
EXAMPLES = 60  # 12,000 operations per run


def apply_events(pool, mirror: dict[bytes, int]) -> None:
    """A router's index rebuilt from the pool's KV-cache events (engine/kserve_paged_engine/core/kv_events.py): each
    hash stored once while not announced, removed once while announced."""
    for event in pool.take_events():
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            for h in event.block_hashes:
                assert h not in mirror, "stored twice"
                mirror[h] = 1
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert mirror.pop(h, None) is not None, "removed but never stored"
        else:
            mirror.clear()
    # Only the first KV group's blocks are announced (docs/kv_groups.md).
    assert mirror.keys() == {h for h, b in pool.cached.items() if b.announced}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(op_strategy, min_size=OPS_PER_EXAMPLE, max_size=OPS_PER_EXAMPLE),
       st.sampled_from(["fcfs", "priority"]), st.booleans(),
       st.sampled_from([None, 9, "mixed"]))
def test_random_operations_keep_the_pool_consistent(ops, policy, caching, window):
    """`window`: every layer slides, so blocks leave running requests as they fall out;
    "mixed": a global and a sliding KV group with their own tables (Gemma), the sliding
    group's blocks leaving while the global group's stay."""
    groups = [None, 9] if window == "mixed" else None
    sched = make_scheduler(num_blocks=NUM_BLOCKS * (2 if groups else 1), block_size=BS,
                           budget=BUDGET, max_num_seqs=MAX_SEQS, caching=caching,
                           policy=policy, sliding_window=None if groups else window,
                           group_windows=groups, record_events=True)
    kv_store: dict[int, tuple[int, int]] = {}
    mirror: dict[bytes, int] = {}
    counter = itertools.count()
    for op in ops:
        OPERATIONS[op[0]](sched, kv_store, counter, op)
        check_invariants(sched)
        apply_events(sched.kv.pool, mirror)
    for rid in list(sched.requests):
        sched.abort(rid)
    check_invariants(sched)
    apply_events(sched.kv.pool, mirror)
    assert sched.kv.pool.reset_prefix_cache()
    apply_events(sched.kv.pool, mirror)
    assert not mirror
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert not sched.requests and not sched.running and not len(sched.waiting)
