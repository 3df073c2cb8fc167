"""bf16 projections where torch refuses oneDNN bf16 (AVX2): F.linear in bf16 against the weight
widened once to fp32 panels for the native GEMM (what `Linear.pack()` does there).

A probe for BENCHMARKS.md (not part of the engine). SmolLM2's four projection shapes, 4 layers
of distinct weights, 1 thread, median of 5 rounds in ms. On a higher machine, emulate AVX2 with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
KSERVE_PAGED_ISA=avx2` (oneDNN is switched off for the F.linear side, as torch does there).

    python bench/probes/bf16_widened_linear.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels.cpu_native import loader  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    torch.set_num_threads(1)
    assert cpu_native.load() is not None
    print("native level", loader.loaded_level().name)
    ws = [torch.randn(n, k).bfloat16() for n, k in SHAPES] * 4
    packed = [cpu_native.pack_gemm_weight(w.float()) for w in ws]
    for rows in (1, 16, 64, 256):
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
        eager, widened = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            with torch.backends.mkldnn.flags(enabled=False):
                for w in ws:
                    F.linear(xs[w.shape[1]], w)
            eager.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for w, p in zip(ws, packed):
                cpu_native.gemm(xs[w.shape[1]].float(), p, w.shape[0]).bfloat16()
            widened.append(time.perf_counter() - t0)
        a, b = statistics.median(eager) * 1e3, statistics.median(widened) * 1e3
        print(f"{rows:4d} rows: F.linear bf16 {a:8.1f} ms, widened native GEMM {b:8.1f} ms, "
              f"{a / b:.2f}x")


if __name__ == "__main__":
    main()
