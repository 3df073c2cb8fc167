"""Shared helpers for the engine-core tests: requests and a simulated model step."""

from __future__ import annotations

import random
import zlib

from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.kv_tier.link import Tier
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.frontend.stop_check import StopCheck
from kserve_paged_engine.sampling_params import SamplingParams

EOS = 2


def make_request(rid: str, tokens: list[int] | int, max_tokens: int = 8, *,
                 salt: str | None = None, priority: int = 0, ignore_eos: bool = True,
                 arrival: float | None = None) -> Request:
    if isinstance(tokens, int):  # distinct per request id, so nothing is shared by accident
        base = zlib.crc32(rid.encode()) % 40_000
        tokens = [base + 3 + (i % 1000) for i in range(tokens)]
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                  eos_token_id=EOS, priority=priority, cache_salt=salt)
    if arrival is not None:
        req.arrival_time = arrival
    return req


def make_scheduler(num_blocks: int = 64, block_size: int = 16, *, budget: int = 2048,
                   max_num_seqs: int = 256, caching: bool = True, policy: str = "fcfs",
                   max_model_len: int | None = None, max_loras: int = 1,
                   sliding_window: int | None = None,
                   group_windows: list[int | None] | None = None,
                   tier: Tier | None = None, record_events: bool = False) -> Scheduler:
    """`group_windows`: one KV group per entry (engine/kserve_paged_engine/core/kv_groups.py), e.g. [None, 8] for a
    model whose global and sliding layers have their own tables. `tier`: a second KV tier.
    `record_events`: the block pool keeps KV-cache events."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             policy=policy, max_loras=max_loras)
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=sliding_window,
                        group_windows=group_windows, tier=tier, record_events=record_events)
    return Scheduler(config, kv, max_model_len or num_blocks * block_size)


def fake_step(sched: Scheduler, out: SchedulerOutput, rng: random.Random | None = None,
              token: int = 7) -> dict[str, int]:
    """What a model step would return: a token for each request whose chunk reached its end."""
    sampled = {}
    for req in out.scheduled:
        n = out.num_scheduled_tokens[req.request_id]
        if req.num_computed_tokens + n >= req.num_tokens:
            sampled[req.request_id] = rng.randrange(3, 50) if rng else token
    return sampled


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        out = sched.schedule()
        outs.append(out)
        apply_step(sched, out, fake_step(sched, out))
    raise AssertionError("requests did not finish")


def apply_step(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None) -> list[Request]:
    """What LLMEngine does with a step's tokens: the stop check (token and length rules; no
    detokenizer, so no stop strings), then the scheduler's update. Returns what ended."""
    ends = StopCheck(sched.max_model_len).check(out, sampled, verified)
    return sched.update_from_output(out, ends)
