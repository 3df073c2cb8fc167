"""The native GEMM per instruction-set level, against another checkout's build and oneDNN.

A probe for BENCHMARKS.md (not part of the engine). It compiles `kernels/kserve_paged_kernels/csrc` of each given
checkout for each given level (`isa.py`'s flags, the loader's sources), loads every build side
by side, and times one pass of SmolLM2's projections (qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536; 30 layers' distinct weights at decode row counts, more than L3 so
they come from memory as in a real step, 4 layers at prefill row counts, where the FMA units
bound it) with each build and with oneDNN's pre-packed weights, the variants interleaved
round by round so the machine's drift hits all alike. Prints the median and the spread.

    python bench/probes/gemm_levels.py [--variant NAME=CHECKOUT:LEVEL ...] [--rows 1 8 ...]

Default variants: this checkout at avx2 and at the CPU's best level, plus oneDNN.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.benchlib import csrc_of  # noqa: E402
from kserve_paged_kernels.cpu_native import isa, loader  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def build(checkout: Path, level: isa.IsaLevel, out: Path) -> ctypes.CDLL:
    """The library of `checkout`'s sources (its own file list) for `level`."""
    csrc = csrc_of(checkout)
    sources = sorted(str(p) for p in csrc.glob("*.c"))
    subprocess.run(["gcc", *loader.flags_for(level), *sources, "-o", str(out), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.kp_gemm_f32.restype = ctypes.c_int
    lib.kp_gemm_f32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]
    return lib


def panel_of(lib: ctypes.CDLL) -> int:
    """The build's panel width (builds before kp_gemm_panel had 48)."""
    return lib.kp_gemm_panel() if hasattr(lib, "kp_gemm_panel") else 48


def pack(w: torch.Tensor, panel: int) -> torch.Tensor:
    n, k = w.shape
    panels = -(-n // panel)
    padded = torch.zeros(panels * panel, k)
    padded[:n] = w
    return padded.view(panels, panel, k).transpose(1, 2).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=CHECKOUT:LEVEL, e.g. old=/work/base:avx512")
    ap.add_argument("--rows", type=int, nargs="*",
                    default=[1, 8, 16, 32, 64, 256, 512, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-onednn", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variant or [f"avx2={ROOT}:avx2", f"{isa.current().name}={ROOT}:"
                                f"{isa.current().name}"]
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(30)]
    kernels: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in variants:
            name, _, where = spec.partition("=")
            checkout, _, level = where.rpartition(":")
            lib = build(Path(checkout), isa.BY_NAME[level], Path(tmp) / f"{name}.so")
            lib.kp_set_threads(args.threads)
            panel = panel_of(lib)
            kernels[name] = (lib, [[pack(w, panel) for w in ws] for ws in weights])
        if not args.no_onednn:
            kernels["oneDNN"] = (None, [[torch.ops.mkldnn._reorder_linear_weight(w, 64)
                                         for w in ws] for ws in weights])
        for rows in args.rows:
            layers = 30 if rows <= 64 else 4
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            ys = {n: torch.empty(rows, n) for n, _ in SHAPES}

            def run(lib, packed, layers=layers, xs=xs, ys=ys, rows=rows) -> None:
                for ps in packed[:layers]:
                    for (n, k), p in zip(SHAPES, ps):
                        if lib is None:
                            torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
                        else:
                            lib.kp_gemm_f32(xs[k].data_ptr(), k, rows, p.data_ptr(), k, n,
                                            None, ys[n].data_ptr(), n)

            times: dict[str, list[float]] = {name: [] for name in kernels}
            for lib, packed in kernels.values():
                run(lib, packed)  # warm-up
            for _ in range(args.rounds):
                for name, (lib, packed) in kernels.items():
                    t0 = time.perf_counter()
                    run(lib, packed)
                    times[name].append(time.perf_counter() - t0)
            flop = 2 * rows * layers * sum(n * k for n, k in SHAPES)
            for name, ts in times.items():
                ts.sort()
                print(json.dumps({
                    "variant": name, "rows": rows, "layers": layers,
                    "ms_median": round(ts[len(ts) // 2] * 1e3, 2),
                    "ms_min": round(ts[0] * 1e3, 2), "ms_max": round(ts[-1] * 1e3, 2),
                    "gflops_median": round(flop / ts[len(ts) // 2] / 1e9, 1),
                    "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
