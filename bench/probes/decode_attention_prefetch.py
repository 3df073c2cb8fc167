"""Decode attention of the fp32 row kernel over a KV cache far larger than L3, 1 and 2 threads.

A probe for BENCHMARKS.md (not part of the engine). SmolLM2's shape (9 query heads on 3 KV
heads of 64), 64 decode rows of `ctx` keys each, a block table per row whose blocks are
consecutive (as a prefill allocates them) and rows spread over a cache 30 layers deep, so each
call reads its K and V from memory as a decode step's layer does. It prints the time per
(row, key) and the K/V bytes read per second. Run it once per tree to compare two kernels
(`PYTHONPATH=<tree>/kernels`), taking turns.

    python bench/probes/decode_attention_prefetch.py [ctx]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from kserve_paged_kernels import cpu_native  # noqa: E402

ROWS, BLOCK, KV_HEADS, HEAD_DIM, HEADS, LAYERS = 64, 16, 3, 64, 9, 30


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    torch.manual_seed(0)
    per_row = -(-ctx // BLOCK)
    kv = torch.randn(2, ROWS * per_row * LAYERS + 1, BLOCK, KV_HEADS, HEAD_DIM)
    q = torch.randn(ROWS, HEADS, HEAD_DIM)
    if not cpu_native.usable(q, kv):
        sys.exit("the row kernel needs the native library (a C compiler and AVX2)")
    starts = torch.randperm(ROWS * LAYERS)[:ROWS] * per_row
    tables = (starts[:, None] + torch.arange(per_row)[None]).int()
    out = torch.empty_like(q)
    lens = torch.full((ROWS,), ctx, dtype=torch.int32)
    rows = torch.arange(ROWS)
    kv_bytes = ROWS * ctx * KV_HEADS * HEAD_DIM * 4 * 2
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for _ in range(3):
            cpu_native.paged_rows(q, kv, tables, lens, rows, rows, 0.125, out)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(30):
                cpu_native.paged_rows(q, kv, tables, lens, rows, rows, 0.125, out)
            runs.append((time.perf_counter() - start) / 30)
        t = statistics.median(runs)
        print(f"threads {threads}: {t * 1e9 / (ROWS * ctx):.1f} ns per (row, key), "
              f"{kv_bytes / t / 1e9:.1f} GB/s of K and V", flush=True)


if __name__ == "__main__":
    main()
