"""Scheduler microbenchmark: time per schedule() + KV bookkeeping at 256 running requests.

Workload: 256 requests with prompts of 1,000-4,000 tokens (seeded), block size 16, a pool large
enough for all of them, prefix caching on. After the prompts are prefilled, each measured step is
`schedule()` (256 decodes) plus the stop check and `update_from_output()` with one sampled token
per request, which covers block allocation, hashing of newly full blocks and stop checks:
everything but the model (and the detokenizer).

    python bench/bench_scheduler.py [--requests 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.frontend.stop_check import StopCheck
from kserve_paged_engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bs = 16
    lens = [rng.randrange(1000, 4001) for _ in range(args.requests)]
    # Room for the prompts plus the tokens decoded while others prefill and while measuring.
    num_blocks = sum((n + args.steps + 200) // bs + 2 for n in lens)
    config = SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=8192)
    sched = Scheduler(config, KVCacheManager(num_blocks, bs), max_model_len=8192)
    stops = StopCheck(sched.max_model_len)  # token and length rules (no stop strings)
    for i, n in enumerate(lens):
        sched.add_request(Request(f"r{i}", [rng.randrange(50_000) for _ in range(n)],
                                  SamplingParams(max_tokens=10_000, ignore_eos=True)))
    # Prefill everything (not measured).
    while len(sched.waiting) or any(r.num_computed_tokens < r.num_tokens - 1
                                    for r in sched.running):
        out = sched.schedule()
        sampled = {r.request_id: 7 for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                   >= r.num_tokens}
        sched.update_from_output(out, stops.check(out, sampled))
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sampled = {r.request_id: 1000 + step for r in out.scheduled}
        sched.update_from_output(out, stops.check(out, sampled))
        times.append(time.perf_counter() - t0)
        assert len(out.scheduled) == args.requests, (step, out.preempted, sched.kv.num_free_blocks)
    times.sort()
    ms = [t * 1e3 for t in times]
    print(f"requests={args.requests} prompt tokens={sum(lens)} steps={args.steps}")
    print(f"schedule+update per step: mean {statistics.mean(ms):.3f} ms, "
          f"p50 {ms[len(ms) // 2]:.3f} ms, p99 {ms[int(len(ms) * 0.99) - 1]:.3f} ms")


if __name__ == "__main__":
    main()
