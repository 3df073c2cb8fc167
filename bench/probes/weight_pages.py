"""Packed weights on 2 MiB pages against the same bytes on 4 KiB pages (cpu_native/huge_pages.py).

A probe for BENCHMARKS.md (not part of the engine). It packs 30 SmolLM2 layers' worth of
distinct fp32 weights plus the LM head (as linear_gemm.py does: more than L3, so every pass
reads them from memory as a decode step does), then times one pass over them for a range of
row counts with the packs where `pack_gemm_weight` puts them (huge pages) and with copies on a
mapping advised MADV_NOHUGEPAGE (4 KiB pages). The two take turns, several rounds; medians.

    python bench/probes/weight_pages.py [rows ...]
"""

from __future__ import annotations

import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kserve_paged_kernels import cpu_native  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (out, in); LM head last
LAYERS = 30
ROUNDS = 5


def small_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on a mapping of its own that the kernel must back with 4 KiB pages."""
    nbytes = t.numel() * t.element_size()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    out = torch.frombuffer(mapping, dtype=torch.uint8).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def one_pass(x_by_k: dict[int, torch.Tensor], packs: list[tuple[torch.Tensor, int, int]]) -> float:
    start = time.perf_counter()
    for packed, n, k in packs:
        cpu_native.gemm(x_by_k[k], packed, n)
    return time.perf_counter() - start


def main() -> None:
    if not cpu_native.gemm_available():
        sys.exit("the packed GEMM needs the native library (a C compiler and AVX2)")
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 32, 64]
    torch.manual_seed(0)
    huge = [(cpu_native.pack_gemm_weight(torch.randn(n, k)), n, k)
            for i in range(LAYERS) for n, k in SHAPES[:-1]]
    huge.append((cpu_native.pack_gemm_weight(torch.randn(*SHAPES[-1])), *SHAPES[-1]))
    small = [(small_pages(p), n, k) for p, n, k in huge]
    weight_bytes = sum(p.numel() * 4 for p, _, _ in huge)
    print(f"{len(huge)} packed weights, {weight_bytes / 2**20:.0f} MiB; threads "
          f"{torch.get_num_threads()}")
    print(f"{'rows':>5} {'2 MiB ms':>9} {'4 KiB ms':>9} {'2 MiB GB/s':>11} {'4 KiB GB/s':>11} "
          f"{'4K/2M':>6}")
    for rows in rows_list:
        x_by_k = {k: torch.randn(rows, k) for _, k in SHAPES}
        one_pass(x_by_k, huge), one_pass(x_by_k, small)  # warm-up
        times: dict[str, list[float]] = {"huge": [], "small": []}
        for _ in range(ROUNDS):
            times["huge"].append(one_pass(x_by_k, huge))
            times["small"].append(one_pass(x_by_k, small))
        th, ts = statistics.median(times["huge"]), statistics.median(times["small"])
        print(f"{rows:5d} {th * 1e3:9.2f} {ts * 1e3:9.2f} {weight_bytes / th / 1e9:11.1f} "
              f"{weight_bytes / ts / 1e9:11.1f} {ts / th:6.3f}")


if __name__ == "__main__":
    main()
