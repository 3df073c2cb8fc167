"""The native bf16 GEMM (csrc/gemm_bf16.c) against oneDNN's pre-packed bf16 linear, per shape.

A probe for BENCHMARKS.md (not part of the engine). SmolLM2-135M's projections (out, in):
qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536, the LM head 49152x576; `--copies`
distinct weights per shape (30: a model's layers, more than L3 for the layer shapes, so they
come from memory as in a real step; the LM head is one weight of 57 MB). For each row count
the two are timed round by round, interleaved; the best round's time per call is printed (on a
loaded machine the best round is the one least disturbed) with the ratio oneDNN / native
(> 1: native faster), and the median ratio over the rounds.

    python bench/probes/gemm_bf16.py [--rows 1 16 64 256] [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels.cpu_native import loader  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _time(fn, calls: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def probe(name: str, rows: int, copies: int, rounds: int) -> dict[str, float | int | str]:
    n, k = SHAPES[name]
    copies = 1 if name == "lm_head" else copies
    ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
    nat = [cpu_native.pack_gemm_weight_bf16(w) for w in ws]
    x = torch.randn(rows, k).bfloat16()
    runs = {
        "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, dnn[i % copies], None,
                                                               "none", [], ""),
        "native": lambda i: cpu_native.gemm_bf16(x, nat[i % copies], n),
    }
    calls = max(copies, int(2e8 / (2 * rows * n * k + 1e6 * 4)))
    calls = max(copies, min(calls, 120))
    times: dict[str, list[float]] = {key: [] for key in runs}
    for fn in runs.values():
        fn(0)
    for _ in range(rounds):
        for key, fn in runs.items():
            times[key].append(_time(fn, calls))
    best = {key: min(v) for key, v in times.items()}
    ratios = [a / b for a, b in zip(times["onednn"], times["native"])]
    return {"shape": name, "rows": rows, "onednn_us": round(best["onednn"] * 1e6, 1),
            "native_us": round(best["native"] * 1e6, 1),
            "speedup": round(best["onednn"] / best["native"], 2),
            "median_round_ratio": round(statistics.median(ratios), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert cpu_native.gemm_available(), "the native library is not loaded"
    print(f"# level {loader.loaded_level().name}, threads {torch.get_num_threads()}")
    for name in args.shapes:
        for rows in args.rows:
            print(json.dumps(probe(name, rows, args.copies, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
