"""How fast this machine reads KV-sized blocks: random single blocks vs runs of adjacent ones.

A probe for the decode-attention analysis in BENCHMARKS.md (not part of the engine): builds
`block_read_bw.c` (sum of every float of the listed 12 KiB blocks, the size of one 16-token
block of K for SmolLM2 in fp32, OpenMP + AVX-512) and times it over 3,400 blocks (~42 MB, more
than L3) laid out in runs of 1..32 adjacent blocks.

    OMP_NUM_THREADS=2 python bench/probes/block_read_bw.py
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "bw.so"
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                        str(HERE / "block_read_bw.c"), "-o", str(lib_path)], check=True)
        fn = ctypes.CDLL(str(lib_path)).sum_blocks
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    num_blocks, blk = 20000, 16 * 3 * 64
    kv = torch.ones(num_blocks * blk)
    for run in (1, 2, 4, 8, 32):
        starts = torch.randperm(num_blocks // run)[:3400 // run] * run
        ids = (starts[:, None] + torch.arange(run)[None, :]).flatten().int()
        for _ in range(3):
            fn(kv.data_ptr(), ids.data_ptr(), ids.numel(), blk)
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(kv.data_ptr(), ids.data_ptr(), ids.numel(), blk)
        dt = (time.perf_counter() - t0) / reps
        print(f"runs of {run:2d} blocks ({run * 12:3d} KiB): "
              f"{ids.numel() * blk * 4 / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
