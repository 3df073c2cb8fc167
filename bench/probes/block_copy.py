"""What copy-on-write costs per step: `kserve_paged_kernels.copy_blocks` on its native path (one memcpy per
block, layer and K/V half) and on its torch path (index_select / index_copy_ per layer cache).

A probe for BENCHMARKS.md (not part of the engine). The shape is the default model's cache in
float32 (30 layers, block size 16, 3 KV heads of 64): a beam step after a fork copies at most
one block per beam, so 1..8 blocks; the figure to compare is a decode step of the same model.

    OMP_NUM_THREADS=2 python bench/probes/block_copy.py [--blocks 1 4 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.block_copy import copy_blocks

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 30, 16, 3, 64, 4096


def time_copy(caches: list[torch.Tensor], n: int, repeats: int) -> float:
    """Median seconds of one copy_blocks call moving n blocks in every layer."""
    g = torch.Generator().manual_seed(n)
    times = []
    for _ in range(repeats):
        perm = torch.randperm(NUM_BLOCKS, generator=g)
        src, dst = perm[:n], perm[n:2 * n]
        t = time.perf_counter()
        copy_blocks(caches, src, dst)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    block_bytes = 2 * BLOCK * HEADS * DIM * 4 * LAYERS  # K and V, every layer
    rows = []
    native = cpu_native.copy_blocks
    for path in ("native", "torch"):
        if path == "torch":  # index_select / index_copy_ per layer, what runs without the library
            cpu_native.copy_blocks = lambda *a: None
        elif cpu_native.load() is None:
            print("native library unavailable: torch path only")
            continue
        for n in args.blocks:
            s = time_copy(caches, n, args.repeats)
            rows.append({"path": path, "blocks": n, "us": round(s * 1e6, 1),
                         "GB_per_s": round(2 * n * block_bytes / s / 1e9, 2)})  # read + write
            print(f"{path:6s} {n} blocks: {s * 1e6:9.1f} us  ({rows[-1]['GB_per_s']} GB/s)")
    cpu_native.copy_blocks = native
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [LAYERS, BLOCK, HEADS, DIM], "dtype": "float32",
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
