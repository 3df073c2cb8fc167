"""The engine-core property test (tests/test_engine_core_property.py) with a second KV tier
under a small pool: evicted blocks go to a real file tier and come back on lookups, and the
simulated KV store checks that every position a request reads holds its own token, so a block
restored into the wrong place, from the wrong key or not at all would be caught, as would a
leaked block or a tier hit counted without its bytes. Preemptions swap (the victim's blocks,
its partial last one included, written at preemption and restored on resume) or recompute, as
the stubbed prefill rate of each run makes the cost model choose (engine/kserve_paged_engine/core/kv_tier/swap.py).
"""

from __future__ import annotations

import itertools
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HostSlot, HostTier
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from tests.helpers.core import make_scheduler
from tests.helpers.core_random_ops import (
    BS,
    BUDGET,
    MAX_SEQS,
    OPERATIONS,
    OPS_PER_EXAMPLE,
    check_invariants,
    op_strategy,
    run_step,
)

SLOT = struct.Struct("<qq")  # a simulated slot: (token, position); (-1, -1) when empty
EXAMPLES = 25
TOTALS = {"hits": 0, "stored": 0, "swap_ins": 0, "recomputes": 0, "host_hits": 0}
# Three long requests in a 16-block pool at a prefill rate that makes every preemption swap:
# whatever examples the search draws, each run swaps requests out and back in.
SWAPPING = [("add", i, 30, 25, None, 0, False) for i in range(3)] + [
    ("step", i) for i in range(60)]


def block_payload(kv_store: dict[int, tuple[int, int]], block_id: int) -> bytes:
    return b"".join(SLOT.pack(*kv_store.get(block_id * BS + off, (-1, -1)))
                    for off in range(BS))


def apply_moves(sched, tier: DiskTier | HostTier, kv_store: dict[int, tuple[int, int]]) -> None:
    """What the model runner does before the forward (engine/kserve_paged_engine/worker/kv_tier_copy.py): for
    the host tier, the saves' bytes taken first, then the loads, then the saves placed."""
    moves = sched._pending_moves
    if moves is None:
        return
    keys = [k for _, k in moves.saves]
    rows = [block_payload(kv_store, b) for b, _ in moves.saves]
    if isinstance(tier, DiskTier):
        tier.store(keys, rows)
    for block_id, payload in moves.loads:
        if isinstance(payload, HostSlot):
            payload = tier.host[payload.slot].numpy().tobytes()
        for off in range(BS):
            token, pos = SLOT.unpack_from(payload, off * SLOT.size)
            slot = block_id * BS + off
            if pos < 0:
                kv_store.pop(slot, None)
            else:
                kv_store[slot] = (token, pos)
    if isinstance(tier, HostTier):
        placed, direct = tier.place(keys)
        tier.spill_rows([keys[i] for i in direct], [rows[i] for i in direct])
        for i, slot in placed:
            tier.host[slot] = torch.frombuffer(bytearray(rows[i]), dtype=torch.uint8)
    # The disk writer works on its own thread: wait for it, so what a later step finds in the
    # tier (and so each run's hits, preemptions and swaps) does not depend on its timing.
    disk = tier if isinstance(tier, DiskTier) else tier.lower
    if disk is not None:
        disk.writer.flush()


class TierScheduler:
    """The scheduler, with its step's tier moves applied to the simulated store before the
    step's writes (run_step reads `schedule()`'s output)."""

    def __init__(self, sched, tier: DiskTier | HostTier, kv_store: dict[int, tuple[int, int]]) -> None:
        self._sched, self._tier, self._store = sched, tier, kv_store
        self._pending_moves = None

    def schedule(self):
        out = self._sched.schedule()
        self._pending_moves = out.tier_moves
        apply_moves(self, self._tier, self._store)
        return out

    def __getattr__(self, name):
        return getattr(self._sched, name)


@pytest.mark.parametrize("host_blocks", [0, 8])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(ops=SWAPPING, policy="fcfs", tier_blocks=30, prefill_rate=1.0)
@given(st.lists(op_strategy, min_size=OPS_PER_EXAMPLE, max_size=OPS_PER_EXAMPLE),
       st.sampled_from(["fcfs", "priority"]), st.integers(2, 30), st.sampled_from([1.0, 1e12]))
def test_random_operations_with_tier_moves_keep_pool_and_reads_right(host_blocks, ops, policy,
                                                                     tier_blocks, prefill_rate):
    """`host_blocks`: a host-memory tier of that many blocks above the disk (0: none; 8, half
    the pool, spills to the disk and hits in both)."""
    with tempfile.TemporaryDirectory() as root:
        tier = disk = DiskTier(Path(root), BS * SLOT.size, tier_blocks * BS * SLOT.size, BS)
        if host_blocks:
            tier = HostTier(BS * SLOT.size, host_blocks * BS * SLOT.size, BS, lower=disk,
                            pin=False)
        sched = make_scheduler(num_blocks=16, block_size=BS, budget=BUDGET,
                               max_num_seqs=MAX_SEQS, policy=policy, tier=tier)
        swaps = sched.kv.tier.swaps
        swaps.prefill = MeasuredRate(prefill_rate, measured=True)  # 1: swap; 1e12: recompute
        kv_store: dict[int, tuple[int, int]] = {}
        wrapped = TierScheduler(sched, tier, kv_store)
        counter = itertools.count()
        for op in ops:
            if op[0] == "step":
                run_step(wrapped, kv_store, op[1])
            else:
                OPERATIONS[op[0]](sched, kv_store, counter, op)
            check_invariants(sched)
            assert tier.num_blocks <= tier.capacity_blocks
        for rid in list(sched.requests):
            sched.abort(rid)
        sched.schedule()  # an empty step: aborted swaps' blocks let go in the tier
        check_invariants(sched)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
        assert tier.stats.hits <= tier.stats.queries
        assert not swaps.swapped and not tier.private and not disk.private  # none outlives
        TOTALS["swap_ins"] += swaps.stats.ins
        TOTALS["recomputes"] += swaps.stats.recomputes
        TOTALS["hits"] += tier.stats.hits
        TOTALS["stored"] += tier.stats.bytes_written
        if isinstance(tier, HostTier):
            assert len(tier.slots) + len(tier.free) == tier.capacity_blocks  # no slot leaks
            TOTALS["host_hits"] += tier.stats.hits
        tier.close()


def test_the_random_runs_moved_blocks_both_ways() -> None:
    """The property above is only worth something if its runs hit the tier and swap requests
    in and out (run after it in this file's order; alone it runs the property first)."""
    if not TOTALS["host_hits"]:
        for host_blocks in (0, 8):
            test_random_operations_with_tier_moves_keep_pool_and_reads_right(host_blocks)
    assert TOTALS["hits"] > 0 and TOTALS["stored"] > 0
    assert TOTALS["swap_ins"] > 0 and TOTALS["recomputes"] > 0 and TOTALS["host_hits"] > 0
