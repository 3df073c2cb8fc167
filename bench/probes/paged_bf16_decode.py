"""Decode attention alone (the row kernels of `kp_paged_rows_bf16`, `kp_paged_rows_f32` and
`kp_paged_rows_q8`): this tree against a git rev.

A probe for BENCHMARKS.md (not part of the engine). The W1-like decode step of SmolLM2-135M:
`--rows` decode rows with contexts drawn from 100-600 (seeded), 9 query heads over 3 KV heads
of `--head-dim` (64), blocks of 16 in shuffled order, a `--kv` cache: bf16 (bf16 queries),
fp32, or int8 codes (fp32 queries). `KSERVE_PAGED_ISA=avx2` times the AVX2 build here. The library of this tree
(the loader's build) and the library built from `--base` (default HEAD: `git archive` of
kernels/kserve_paged_kernels/csrc into a temp dir, compiled with the loader's flags for the same level) are called
straight through ctypes, interleaved round by round (the order swapped each round), best of
`--rounds`, per thread count. `--layers` separate caches are cycled through as a model's
layers are, so the keys and values come from memory rather than a warm L3 (`--layers 1`: one
layer, cache-resident). Also printed: each build's largest and mean error against fp32
attention over the same cache values, and whether the two agree bit for bit.

    python bench/probes/paged_bf16_decode.py [--base REV] [--threads 1,2] [--rounds R]
        [--rows N] [--layers L] [--head-dim D] [--kv bf16|fp32|int8]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.benchlib import csrc_of  # noqa: E402
from kserve_paged_kernels.cpu_native import abi, loader  # noqa: E402
from kserve_paged_kernels.kv_quant import QuantKV, dequantize, storage_dtype, store_kv_quant  # noqa: E402
from kserve_paged_kernels.metadata import AttentionMetadata  # noqa: E402
from kserve_paged_kernels.reference import paged_attention_ref  # noqa: E402
from kserve_paged_kernels.testing import make_case  # noqa: E402


def build_base(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The library as of git rev `rev`, for the level the loader picked here."""
    src = out_dir / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    csrc = csrc_of(src)
    so = out_dir / "base.so"
    proc = subprocess.run([loader.find_compiler(), *loader.flags_for(loader.loaded_level()),
                           *(str(csrc / p.name) for p in loader.SOURCES), "-o", str(so), "-lm"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return ctypes.CDLL(str(so))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in ("kp_paged_rows_bf16", "kp_paged_rows_f32", "kp_paged_rows_q8"):
        restype, argtypes = abi.FUNCTIONS[name]
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, list(argtypes)
    lib.kp_set_threads.restype, lib.kp_set_threads.argtypes = None, [ctypes.c_int]
    return lib


def make_calls(rows: int, layers: int, head_dim: int, kv_kind: str) -> tuple[list, list[int],
                                                                             tuple]:
    """One layer's kernel arguments per layer (W1-like decode rows), the contexts, and the
    first layer's attention arguments over fp32 cache values (for the fp32 truth)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 601, (rows,), generator=gen).tolist()
    dtype = torch.bfloat16 if kv_kind == "bf16" else torch.float32
    cases = [make_case(lens, [1] * rows, num_heads=9, num_kv_heads=3, head_dim=head_dim,
                       dtype=dtype, seed=layer) for layer in range(layers)]
    calls, truth_args = [], None
    for case in cases:
        q, kv, bt, seq_lens, starts, scale = case.args()
        meta = AttentionMetadata.build(bt, seq_lens, starts)
        row_lens, row_seq = meta.rows(rows)
        bt, row_lens = bt.contiguous(), row_lens.int().contiguous()
        tok, seq = torch.arange(rows), row_seq.long().contiguous()
        values = kv.float()
        if kv_kind == "int8":  # the same values stored as codes, as the engine's store does
            codes = QuantKV.zeros(tuple(kv.shape), storage_dtype("int8"))
            flat = kv.reshape(2, -1, kv.shape[3], kv.shape[4])
            store_kv_quant(flat[0], flat[1], codes, torch.arange(flat.shape[1]))
            kv, values = codes, dequantize(codes)
        truth_args = truth_args or (q.float(), values, *case.args()[2:])
        calls.append((kv_kind, q, kv, bt, row_lens, tok, seq, scale, torch.zeros_like(q)))
    return calls, lens, truth_args


def run(lib: ctypes.CDLL, c: tuple) -> None:
    kind, q, kv, bt, row_lens, tok, seq, scale, out = c
    rows = (bt.data_ptr(), bt.stride(0), row_lens.data_ptr(), tok.data_ptr(), seq.data_ptr(),
            tok.numel(), float(scale), 0, 0.0, out.data_ptr(), out.stride(0))
    if kind == "int8":
        shape = kv.data.shape
        rc = lib.kp_paged_rows_q8(q.data_ptr(), q.stride(0), kv.data.data_ptr(),
                                  kv.scales.data_ptr(), abi.KV_FORMATS["int8"], *shape[1:],
                                  q.shape[1], *rows)
    else:
        fn = lib.kp_paged_rows_bf16 if kind == "bf16" else lib.kp_paged_rows_f32
        rc = fn(q.data_ptr(), q.stride(0), kv.data_ptr(), *kv.shape[1:], q.shape[1], *rows)
    assert rc == 0, rc


def best_ms(libs: dict[str, ctypes.CDLL], calls: list, threads: int, rounds: int) -> dict:
    """Best ms per layer call of each library, interleaved, the order swapped each round."""
    for lib in libs.values():
        lib.kp_set_threads(threads)
        for c in calls:
            run(lib, c)  # warm: code, scratch, threads
    best = {k: float("inf") for k in libs}
    for r in range(rounds):
        for name, lib in sorted(libs.items(), reverse=r % 2 == 1):
            t0 = time.perf_counter()
            for c in calls:
                run(lib, c)
            best[name] = min(best[name], (time.perf_counter() - t0) / len(calls) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv", choices=("bf16", "fp32", "int8"), default="bf16")
    args = ap.parse_args()
    assert loader.load() is not None
    calls, lens, truth_args = make_calls(args.rows, args.layers, args.head_dim, args.kv)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": bind(build_base(args.base, Path(tmp))), "new": bind(loader.loaded())}
        outs = {}
        for name, lib in libs.items():
            run(lib, calls[0])
            outs[name] = calls[0][-1].clone()
        truth = paged_attention_ref(*truth_args)
        diff = {k: (o.float() - truth).abs() for k, o in outs.items()}
        err = {k: {"max": float(d.max()), "mean": float(d.mean())} for k, d in diff.items()}
        print(f"level {loader.loaded_level().name}, {args.kv} cache, head dim {args.head_dim}, rows {args.rows}, "
              f"contexts mean "
              f"{sum(lens) / len(lens):.0f}, layers {args.layers}; |err| vs fp32 (max, mean): "
              + ", ".join(f"{k} {v['max']:.2e} {v['mean']:.2e}" for k, v in err.items())
              + f"; bitwise equal: {torch.equal(outs['base'], outs['new'])}", flush=True)
        result = {}
        for threads in (int(t) for t in args.threads.split(",")):
            best = result[threads] = best_ms(libs, calls, threads, args.rounds)
            print(f"threads {threads}: ms per layer call, best of {args.rounds}: base "
                  f"{best['base']:.3f}, new {best['new']:.3f}, speedup "
                  f"{best['base'] / best['new']:.2f}x", flush=True)
    print(json.dumps({"level": loader.loaded_level().name, "kv": args.kv, "head_dim": args.head_dim,
                      "rows": args.rows,
                      "layers": args.layers, "max_err": err, "ms": result}))


if __name__ == "__main__":
    main()
