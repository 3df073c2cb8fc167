"""Quantized projections with bf16 activations: our kernel (csrc/quant_gemm.c, bf16 variant)
against PyTorch's packed int4 kernel (`_weight_int4pack_mm_for_cpu`) and the dense native bf16
GEMM (csrc/gemm_bf16.c) over the same weights, per shape and row count.

A probe for BENCHMARKS.md (not part of the engine). SmolLM2-135M's projections (out, in):
qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536; int4 in groups of 32 (Q4_1's form),
and int8 in groups of 32 (Q8_0) for ours; `--copies` distinct weights per shape (a model's
layers, so they come from memory as in a real step). The kernels are timed round by round,
interleaved; the best round's time per call is printed (on a loaded machine the best round is
the least disturbed) with the ratios int4pack / ours and dense / ours (> 1: ours faster).
`lm_head` is the tied 49152x576 LM head (one copy: it alone is 14 MiB at 4 bits).

`--baseline DIR` also times another tree's kernel in the same run: DIR's kernels/kserve_paged_kernels/csrc built
with this tree's flags for the loaded level (e.g. `git worktree add /tmp/base HEAD~1`), called
on the same packed weights (the layout must not differ), as base_int4 and base_int8 with
base/ours and base8/ours8.

    python bench/probes/quant_bf16.py [--rows 1 16 64 256 512] [--rounds 9] [--threads 2]
        [--shapes qkv o gate_up down lm_head] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.benchlib import csrc_of  # noqa: E402
from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels import quant_linear as ql  # noqa: E402
from kserve_paged_kernels.cpu_native import abi, loader  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
_BASE: ctypes.CDLL | None = None


def _build_baseline(tree: Path) -> ctypes.CDLL:
    """Another tree's native library, built for the loaded level into a temporary directory."""
    level = loader.loaded_level()
    assert level is not None
    out = Path(tempfile.mkdtemp(prefix="kp_base_")) / "libbase.so"
    sources = [csrc_of(tree) / src.name for src in loader.SOURCES]
    subprocess.run([loader.find_compiler() or "gcc", *loader.flags_for(level), *map(str, sources),
                    "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    abi.declare(lib)
    return lib


def _base_mm(x: torch.Tensor, w: ql.Int4Weight | ql.Int8Weight, bits: int) -> torch.Tensor:
    """`x @ w.T` by the baseline library's kp_quant_gemm_bf16 (our packing)."""
    assert _BASE is not None
    n, k = w.out_features, x.shape[1]
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    rc = _BASE.kp_quant_gemm_bf16(x.data_ptr(), x.stride(0), x.shape[0], w.packed.data_ptr(),
                                  bits, w.group_size, k, n, None, out.data_ptr(), n)
    assert rc == 0
    return out


def _time(fn, calls: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def _weights(n: int, k: int) -> tuple[ql.Int4Weight, ql.Int4Weight, ql.Int8Weight, torch.Tensor]:
    """One weight as ours (int4, int8), PyTorch's int4 and the dense bf16 pairs."""
    w = torch.randn(n, k) * 0.05
    codes, scale, minimum = ql.quantize_int4(w, 32)
    ours = ql.pack_int4(codes, scale, minimum, 32, torch.bfloat16)
    keep = ql.native_for
    ql.native_for = lambda dtype: False  # type: ignore[assignment]  # PyTorch's packing
    try:
        aten = ql.pack_int4(codes, scale, minimum, 32, torch.bfloat16)
    finally:
        ql.native_for = keep  # type: ignore[assignment]
    q8 = ql.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                      torch.rand(n, k // 32) * 1e-3, 32, torch.bfloat16)
    dense = cpu_native.pack_gemm_weight_bf16(ql.dequant(ours).bfloat16())
    return ours, aten, q8, dense


def probe(name: str, rows: int, copies: int, rounds: int) -> dict[str, float | int | str]:
    n, k = SHAPES[name]
    copies = 1 if name == "lm_head" else copies
    ws = [_weights(n, k) for _ in range(copies)]
    assert ws[0][0].kernel == "native" and ws[0][1].kernel == "aten"
    x = torch.randn(rows, k).bfloat16()
    runs = {
        "ours_int4": lambda i: ql.int4_mm(x, ws[i % copies][0]),
        "int4pack": lambda i: ql.int4_mm(x, ws[i % copies][1]),
        "ours_int8": lambda i: ql.int8_mm(x, ws[i % copies][2]),
        "dense_bf16": lambda i: cpu_native.gemm_bf16(x, ws[i % copies][3], n),
    }
    if _BASE is not None:
        runs["base_int4"] = lambda i: _base_mm(x, ws[i % copies][0], 4)
        runs["base_int8"] = lambda i: _base_mm(x, ws[i % copies][2], 8)
    calls = max(copies, min(120, int(2e8 / (2 * rows * n * k + 4e6))))
    times: dict[str, list[float]] = {key: [] for key in runs}
    for fn in runs.values():
        fn(0)
    for _ in range(rounds):
        for key, fn in runs.items():
            times[key].append(_time(fn, calls))
    best = {key: min(v) for key, v in times.items()}
    return {"shape": name, "rows": rows,
            **{f"{key}_us": round(t * 1e6, 1) for key, t in best.items()},
            "int4pack/ours": round(best["int4pack"] / best["ours_int4"], 2),
            "dense/ours": round(best["dense_bf16"] / best["ours_int4"], 2),
            **({"base/ours": round(best["base_int4"] / best["ours_int4"], 2),
                "base8/ours8": round(best["base_int8"] / best["ours_int8"], 2)}
               if "base_int4" in best else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--baseline", type=Path, help="another tree to time in the same run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert cpu_native.native_bf16_quant(), "the bf16 quantized kernel is not chosen here"
    if args.baseline:
        global _BASE
        _BASE = _build_baseline(args.baseline)
        _BASE.kp_set_threads(torch.get_num_threads())
    print(f"# level {loader.loaded_level().name}, threads {torch.get_num_threads()}")
    for name in args.shapes:
        for rows in args.rows:
            print(json.dumps(probe(name, rows, args.copies, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
