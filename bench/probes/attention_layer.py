"""One attention layer on the CPU backend, the native row kernel against the SDPA path, at
the shapes of the two real models: decode batches and prefill chunks, global and windowed.

A probe for BENCHMARKS.md ("Attention on AVX2"; not part of the engine). The step's plan is
shared by 6 calls, as layers share it in a step; fp32, block size 16, median.

    OMP_NUM_THREADS=2 python bench/probes/attention_layer.py [--shape smollm2|gemma3]
"""

from __future__ import annotations

import argparse
import time

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_backend import paged_attention_cpu
from kserve_paged_kernels.metadata import AttentionMetadata
from kserve_paged_kernels.testing import make_case

SHAPES = {"smollm2": (9, 3, 64, (None,)), "gemma3": (4, 1, 256, (512, None))}
BATCHES = [("decode 4x300", [300] * 4, [1] * 4, 15), ("decode 8x2048", [2048] * 8, [1] * 8, 15),
           ("decode 32x1024", [1024] * 32, [1] * 32, 15),
           ("decode 64x600", [600] * 64, [1] * 64, 9),
           ("prefill 1x1024", [1024], [1024], 5), ("chunk 512 of 2048", [2048], [512], 5)]


def median_ms(case, window: int | None, native: bool, reps: int) -> float:
    real_usable, real_tiles = cpu_native.usable, cpu_native.prefill_tiles
    cpu_native.usable = real_usable if native else (lambda *a: False)
    cpu_native.prefill_tiles = lambda: True  # native: every row to the row kernel
    try:
        times = []
        for _ in range(reps):
            meta = AttentionMetadata.build(*case.args()[2:5])
            t0 = time.perf_counter()
            for _ in range(6):
                paged_attention_cpu(case.query, case.kv_cache, meta, case.scale, window=window)
            times.append((time.perf_counter() - t0) / 6)
    finally:
        cpu_native.usable, cpu_native.prefill_tiles = real_usable, real_tiles
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = ap.parse_args()
    if cpu_native.load() is None:
        raise SystemExit("the native library is not built here")
    heads, kv_heads, head_dim, windows = SHAPES[args.shape]
    for name, seq_lens, q_lens, reps in BATCHES:
        case = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, block_size=16, seed=0)
        for window in windows:
            native = median_ms(case, window, True, reps)
            sdpa = median_ms(case, window, False, reps)
            print(f"{args.shape} {name} window={window}: native {native:.2f} ms, SDPA "
                  f"{sdpa:.2f} ms, SDPA / native {sdpa / native:.2f}", flush=True)


if __name__ == "__main__":
    main()
