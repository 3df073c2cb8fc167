"""Requests forked from one another (n > 1 samples, beams) as one unit of KV memory.

They share blocks, so they are sized, admitted and recomputed together: a waiting beam search
needs room for every fork at once (`fork_blocks`, an upper bound); a fork recomputed after
a preemption takes the full blocks it has in common with a fork ahead of it
(`share_among_forks`, `best_hit`), with prefix caching off too, instead of holding its history a
second time. Design: docs/engine.md, "Scheduling, preemption, ending".
"""

from __future__ import annotations

from collections.abc import Iterable

from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.prefix_hits import PrefixHit
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.sampling_params import SamplingParams


def forked_request(parent: Request, child_id: str, params: SamplingParams | None,
                   num_computed: int | None) -> Request:
    """A fork of `parent`: its tokens so far, its block hashes and timings;
    `num_computed` when the parent's step is not yet counted."""
    return Request(child_id, parent.prompt_token_ids, params or parent.sampling_params,
                   eos_token_id=parent.eos_token_id, priority=parent.priority,
                   cache_salt=parent.cache_salt, lora_request=parent.lora_request,
                   arrival_time=parent.arrival_time,
                   output_token_ids=list(parent.output_token_ids),
                   num_computed_tokens=(parent.num_computed_tokens if num_computed is None
                                        else num_computed),
                   num_cached_tokens=parent.num_cached_tokens,
                   fork_root=parent.fork_root or parent.request_id,
                   block_hashes=list(parent.block_hashes),
                   first_scheduled_time=parent.first_scheduled_time)


def fork_blocks(kv: KVCacheManager, unit: list[Request]) -> int:
    """Blocks waiting forks need to hold their tokens and take one more step, each fork
    sharing the full blocks it has in common with a fork ahead of it (an upper bound on
    what admitting it consumes: prefix-cache hits only lower it), in every KV group (a
    sliding one's too: its first step writes every prompt token)."""
    bs = kv.block_size
    need = 0
    for j, member in enumerate(unit):
        shared = max((min(member.common_prefix_len(a), member.num_tokens - 1) // bs
                      for a in unit[:j]), default=0)
        need += -(-(member.num_tokens + 1) // bs) - shared
    return need * kv.num_groups


def best_hit(kv: KVCacheManager, request: Request, running: Iterable[Request],
             scheduled: dict[str, int]) -> PrefixHit:
    """The longer of the prefix-cache hit and the blocks a running sibling (a fork of the same
    request) holds for their common tokens."""
    hit = kv.find_prefix(request)
    if request.fork_root is None:
        return hit
    for sibling in running:
        if sibling.fork_root == request.fork_root:
            valid = sibling.num_computed_tokens + scheduled.get(sibling.request_id, 0)
            other = kv.sibling_hit(request, sibling, valid)
            if other.num_tokens > hit.num_tokens:
                hit = other
    return hit


def share_among_forks(kv: KVCacheManager, unit: list[Request], step_tokens: dict[str, int]
                      ) -> set[str]:
    """Hand each fork the full blocks it has in common with a fork ahead of it in `unit`
    (KVCacheManager.sibling_hit), and return the forks that follow: their common prefix with
    a fork ahead is not written yet, so they wait for it rather than compute it a second
    time. The first fork never waits, so the forks progress."""
    bs = kv.block_size
    following: set[str] = set()
    for j, member in enumerate(unit):
        for ahead in unit[:j]:
            valid = ahead.num_computed_tokens + step_tokens.get(ahead.request_id, 0)
            hit = kv.sibling_hit(member, ahead, valid)
            if hit.blocks:
                allocated = kv.allocate_slots(member, 0, hit)
                assert allocated, "shared blocks cost no free block"
                member.num_computed_tokens += hit.num_tokens
        if member.num_computed_tokens % bs:
            continue  # its own partial block: it cannot take shared blocks any more
        for ahead in unit[:j]:
            valid = ahead.num_computed_tokens + step_tokens.get(ahead.request_id, 0)
            shareable = min(member.common_prefix_len(ahead), member.num_tokens - 1)
            shareable -= shareable % bs
            if member.num_computed_tokens < shareable and valid < shareable:
                following.add(member.request_id)
                break
    return following
