"""Who may be preempted for whom, and whether preempting them could make room.

A victim is the worst running request (policy order, `request_queue.policy_key`) not
scheduled in this step; a request scheduled in this step, or one of its forks, never is:
its new blocks are registered in the prefix cache already and others may have hit them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kserve_paged_engine.core.block_pool import KVBlock
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.core.scheduler_output import StepBuild

PolicyKey = Callable[[Request], tuple[int, float]]


def victim_for(running: list[Request], step: StepBuild, candidate: Request, key: PolicyKey
               ) -> Request | None:
    """The worst running request not yet scheduled this step (nor in a scheduled request's
    forks), if worse than `candidate`; for a running candidate, possibly itself."""
    busy = {r.fork_root for r in step.order if r.fork_root is not None}
    pool = [r for r in running if r.request_id not in step.scheduled and r.fork_root not in busy]
    if not pool:
        return None
    worst = max(pool, key=key)
    if candidate.status is RequestStatus.RUNNING:
        return worst  # may be the candidate itself
    return worst if key(worst) > key(candidate) else None


def reclaimable(kv: KVCacheManager, running: Iterable[Request], scheduled: dict[str, int],
                candidate: Request, key: PolicyKey) -> int:
    """Blocks that preempting every eligible victim of `candidate` (worse, not scheduled this
    step) together would return. Checked before preempting any: victims preempted one by one
    for a request that still does not fit would be preempted for nothing."""
    worse = key(candidate)
    return num_reclaimable(kv, [r.request_id for r in running
                                if r.request_id not in scheduled and key(r) > worse])


def num_reclaimable(kv: KVCacheManager, request_ids: list[str]) -> int:
    """Blocks that freeing all these requests together returns (held by no one else)."""
    holders: dict[int, int] = {}
    blocks: dict[int, KVBlock] = {}
    for rid in request_ids:
        for b in kv.held_blocks(rid):
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
            blocks[b.block_id] = b
    return sum(1 for i, n in holders.items() if blocks[i].ref_cnt == n)
