"""CPU timing of the cpu backend on the SmolLM2-135M attention shape.

Run: `python -m kserve_paged_kernels.bench_torch [--budgets 1024,2048,...] [--threads 1]`. Prints, per call
(= one layer; x30 for a model step), the median wall time and the median process CPU time.
On a shared host trust the CPU time: with other processes on the cores, OpenMP threads stall
at barriers and wall time balloons (seen here: 5-10x at load 3 on 2 cores).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kserve_paged_kernels.cpu_backend import paged_attention_cpu
from kserve_paged_kernels.metadata import AttentionMetadata
from kserve_paged_kernels.testing import make_case

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median (wall ms, process-CPU ms) of `reps` calls after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", default="16384")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    workloads = {
        "decode 256 x ctx 500": ([500] * 256, [1] * 256),
        "decode 256 x ctx U(64,800)": ([rng.randint(64, 800) for _ in range(256)], [1] * 256),
        "prefill 1 x 2048": ([2048], [2048]),
        "chunked prefill 512 after 1536 cached": ([2048], [512]),
        "mixed: 128 decode U(64,800) + prefill 1024": (
            [rng.randint(64, 800) for _ in range(128)] + [1024], [1] * 128 + [1024]),
    }
    print(f"torch threads: {torch.get_num_threads()}")
    for name, (seq_lens, q_lens) in workloads.items():
        case = make_case(seq_lens, q_lens, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, block_size=16)
        for budget in (int(b) for b in args.budgets.split(",")):
            # One step's metadata reused by every repeat, as the layers of a step reuse it.
            meta = AttentionMetadata.build(case.block_tables, case.seq_lens,
                                           case.query_start_loc)
            wall, cpu = _time(lambda c=case, m=meta, b=budget: paged_attention_cpu(
                c.query, c.kv_cache, m, c.scale, decode_token_budget=b), args.reps)
            print(f"{name:45s} budget={budget:6d}: wall {wall:8.2f} ms  cpu {cpu:8.2f} ms")


if __name__ == "__main__":
    main()
