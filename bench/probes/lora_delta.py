"""What the LoRA delta of one projection costs per call: the native one-call kernel
(`kserve_paged_kernels.cpu_native.lora_sgmv`) against the per-adapter torch loop it replaced on CPU
(index_select, two matmuls and index_add per adapter; `engine/kserve_paged_engine/lora/batch.py`).

A probe for BENCHMARKS.md (not part of the engine). Shapes are the default model's: hidden 576,
the widest projection 576 -> 3072 (gate and up fused); four rank-8 adapters; decode steps of
4 and 16 rows and a 512-row prefill chunk, rows spread evenly over the adapters. A step of the
default model calls this 7 times per layer, 30 layers.

    OMP_NUM_THREADS=2 python bench/probes/lora_delta.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kserve_paged_engine.lora.adapter import LoRAAdapter, LoRAWeights
from kserve_paged_engine.lora.batch import (
    LoRAStep,
    SlotStacks,
    add_lora_delta,
    group_rows,
    sgmv_step,
)
from kserve_paged_kernels import cpu_native

HIDDEN, ADAPTERS, RANK = 576, 4, 8
SHAPES = (("q/o 576->576", 576), ("gate_up 576->3072", 3072))


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 512])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if cpu_native.load() is None:
        raise SystemExit("the native library is not built here")
    g = torch.Generator().manual_seed(0)
    results = []
    for label, out_f in SHAPES:
        key = (0, label)
        adapters = tuple(LoRAAdapter(f"a{i}", 8, {key: LoRAWeights(
            torch.randn(RANK, HIDDEN, generator=g) * 0.1,
            torch.randn(out_f, RANK, generator=g) * 0.1)}) for i in range(ADAPTERS))
        stacks = SlotStacks(adapters, rank_major=True)
        for n in args.rows:
            ids = np.arange(n, dtype=np.int64) % ADAPTERS + 1
            rows, runs = group_rows(ids)
            segments = [(adapters[i - 1], s, e) for i, s, e in runs]
            torch_step = LoRAStep(torch.from_numpy(rows), segments)
            native_step = LoRAStep(torch.from_numpy(rows), segments,
                                   sgmv_step(segments, stacks, torch.device("cpu"), "native"))
            x = torch.randn(n, HIDDEN, generator=g)
            out = torch.zeros(n, out_f)
            reps = max(5, args.repeats if n <= 16 else args.repeats // 10)
            t_torch = median_seconds(lambda s=torch_step, x=x, o=out, k=key:
                                     add_lora_delta(x, o, s, k), reps)
            t_native = median_seconds(lambda s=native_step, x=x, o=out, k=key:
                                      add_lora_delta(x, o, s, k), reps)
            results.append({"projection": label, "rows": n, "torch_us": round(t_torch * 1e6, 1),
                            "native_us": round(t_native * 1e6, 1),
                            "native_over_torch": round(t_native / t_torch, 2)})
            print(results[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
