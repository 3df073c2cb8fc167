"""The linear layers of one SmolLM2 forward: native GEMM (kernels/kserve_paged_kernels/csrc/gemm.c) vs oneDNN.

A probe for BENCHMARKS.md (not part of the engine). It builds 30 layers' worth of distinct
weights (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536: 424 MB, far more than L3,
so every pass reads them from memory as a real step does) plus the 49152x576 LM head, and
times one pass over them for a range of row counts, with oneDNN's pre-packed weights and with
the native panels.

    python bench/probes/linear_gemm.py [rows ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kserve_paged_kernels import cpu_native  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30
VOCAB = 49152


def main() -> None:
    if not cpu_native.gemm_available():
        sys.exit("the native GEMM needs the native library (a C compiler and AVX2)")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    lm_head = torch.randn(VOCAB, 576)
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in weights]
    onednn_lm = torch.ops.mkldnn._reorder_linear_weight(lm_head, 64)
    native = [[cpu_native.pack_gemm_weight(w) for w in ws] for ws in weights]
    native_lm = cpu_native.pack_gemm_weight(lm_head)
    flop_per_row = 2 * sum(n * k for n, k in SHAPES) * LAYERS
    weight_bytes = 4 * sum(n * k for n, k in SHAPES) * LAYERS

    def timed(fn, rows: int) -> float:
        for _ in range(2):
            fn()
        reps = 5 if rows <= 64 else 2
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps

    rows_list = [int(a) for a in sys.argv[1:]] or [1, 8, 16, 32, 48, 64, 128, 512, 2048]
    print(f"{'kernel':8s} {'rows':>5s} {'body ms':>8s} {'GFLOP/s':>8s} {'GB/s':>6s} "
          f"{'LM head ms':>10s}")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}

        def onednn_body(xs=xs) -> None:
            for ps in onednn:
                for (_, k), p in zip(SHAPES, ps):
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

        def native_body(xs=xs) -> None:
            for ps in native:
                for (n, k), p in zip(SHAPES, ps):
                    cpu_native.gemm(xs[k], p, n)

        runs = {
            "oneDNN": (onednn_body, lambda xs=xs: torch.ops.mkldnn._linear_pointwise(
                xs[576], onednn_lm, None, "none", [], "")),
            "native": (native_body, lambda xs=xs: cpu_native.gemm(xs[576], native_lm, VOCAB)),
        }
        for name, (body, head) in runs.items():
            t_body, t_head = timed(body, rows), timed(head, rows)
            print(f"{name:8s} {rows:5d} {t_body * 1e3:8.1f} {flop_per_row * rows / t_body / 1e9:8.1f} "
                  f"{weight_bytes / t_body / 1e9:6.1f} {t_head * 1e3:10.1f}")


if __name__ == "__main__":
    main()
