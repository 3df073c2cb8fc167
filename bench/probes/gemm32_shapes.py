"""Gemma-3-270M's fp32 projections: the native GEMM (kernels/kserve_paged_kernels/csrc/gemm.c) against torch.

A probe for BENCHMARKS.md (not part of the engine). Gemma-3-270M's layer has qkv 1536x640
(fused), o 640x1024, gate/up 4096x640 (fused) and down 640x2048, 18 layers, and a tied
262,144 x 640 LM head. Each shape is timed at each row count with the native panels, with
torch's `F.linear` and with oneDNN's pre-packed weight (`_linear_pointwise`, what `Linear.pack`
falls back to), best of several rounds, the three interleaved round by round so the machine's
drift hits all alike. "gate_up+gelu" is Gemma's MLP first half with its GELU-and-multiply:
`gemm_gelu` over panel pairs against each torch product followed by torch's tanh-GELU and
multiply. At 1 thread the times are the process's CPU time (a loaded machine's waits left
out); at more, wall time. Up to 64 rows every layer has its own weights (400 MB, more than L3, so
they come from memory as in a real decode step); past that 2 layers (the FMA units bound it).
The LM head is timed up to 64 rows only: the engine multiplies only each sequence's last
token by it.

    python bench/probes/gemm32_shapes.py [--threads 1 2] [--rows 1 4 16 ...] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kserve_paged_kernels import cpu_native  # noqa: E402

HIDDEN, LAYERS, VOCAB = 640, 18, 262144
SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048),
          "gate_up+gelu": (4096, 640)}
HEAD_ROWS_MAX = 64


def best_of(fn, rounds: int, reps: int, clock) -> float:
    """Seconds per call, best of `rounds` rounds of `reps` calls (after one warm call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - start) / reps)
    return best


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def main() -> None:
    """Long because the probe is one interleaved table: threads x shapes x rows, three ways each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=[*SHAPES, "lm_head"])
    args = ap.parse_args()
    if not cpu_native.gemm_available():
        sys.exit("the native GEMM needs the native library")
    torch.manual_seed(0)
    body = {name: [torch.randn(n, k) * 0.05 for _ in range(LAYERS)]
            for name, (n, k) in SHAPES.items() if name in args.shapes}
    native = {name: [(cpu_native.pack_gate_up_weight(w) if name == "gate_up+gelu"
                      else cpu_native.pack_gemm_weight(w)) for w in ws]
              for name, ws in body.items()}
    onednn = {name: [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
              for name, ws in body.items()}
    head = head_native = head_onednn = None
    if "lm_head" in args.shapes:
        head = torch.randn(VOCAB, HIDDEN) * 0.05
        head_native = cpu_native.pack_gemm_weight(head)
        head_onednn = torch.ops.mkldnn._reorder_linear_weight(head, 16)

    print(f"{'thr':>3s} {'shape':12s} {'rows':>5s} {'native ms':>9s} {'F.linear':>9s} "
          f"{'oneDNN':>9s} {'nat GF/s':>8s} {'nat GB/s':>8s} {'best torch/nat':>14s}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        for name in [*body, *(["lm_head"] if head is not None else [])]:
            n, k = SHAPES.get(name, (VOCAB, HIDDEN))
            for rows in args.rows:
                if name == "lm_head":
                    if rows > HEAD_ROWS_MAX:
                        continue
                    layers, ws, nat, dnn = 1, [head], [head_native], [head_onednn]
                else:
                    layers = LAYERS if rows <= 64 else 2
                    ws, nat, dnn = body[name][:layers], native[name][:layers], onednn[name][:layers]
                x = torch.randn(rows, k)
                if name == "gate_up+gelu":
                    runs = {
                        "native": lambda x=x, nat=nat, n=n: [
                            cpu_native.gemm_gelu(x, p, n // 2) for p in nat],
                        "F.linear": lambda x=x, ws=ws: [gelu_mul(F.linear(x, w)) for w in ws],
                        "oneDNN": lambda x=x, dnn=dnn: [gelu_mul(
                            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
                            for p in dnn],
                    }
                else:
                    runs = {
                        "native": lambda x=x, nat=nat, n=n: [
                            cpu_native.gemm(x, p, n) for p in nat],
                        "F.linear": lambda x=x, ws=ws: [F.linear(x, w) for w in ws],
                        "oneDNN": lambda x=x, dnn=dnn: [
                            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                            for p in dnn],
                    }
                flop = 2.0 * rows * n * k * layers
                reps = max(1, min(20, int(2e9 / max(flop, 1.0))))
                t = {key: float("inf") for key in runs}
                for _ in range(args.rounds):  # interleaved: one round of each, again and again
                    for key, fn in runs.items():
                        t[key] = min(t[key], best_of(fn, 1, reps, clock))
                per = {key: v / layers for key, v in t.items()}
                ratio = min(per["F.linear"], per["oneDNN"]) / per["native"]
                print(f"{threads:3d} {name:12s} {rows:5d} {per['native'] * 1e3:9.3f} "
                      f"{per['F.linear'] * 1e3:9.3f} {per['oneDNN'] * 1e3:9.3f} "
                      f"{flop / t['native'] / 1e9:8.1f} "
                      f"{4.0 * n * k * layers / t['native'] / 1e9:8.1f} {ratio:14.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
