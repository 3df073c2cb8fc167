"""CPU attention per instruction-set level: the native kernel of each build against SDPA.

A probe for BENCHMARKS.md (not part of the engine). It compiles `kernels/kserve_paged_kernels/csrc` of each given
checkout for each given level (as `gemm_levels.py` does), and times one attention layer of
SmolLM2's shape (9 query heads over 3 KV heads of 64, fp32, blocks of 16 in shuffled order)
through `kp_paged_rows_f32` of every build and through the CPU backend's SDPA path (native
kernels off), the variants interleaved round by round. Decode batches go to the row kernel,
prefill runs of >= 32 rows to the transposed-key tiles where the build has them.

    python bench/probes/attention_levels.py [--variant NAME=CHECKOUT:LEVEL ...] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))
from gemm_levels import build  # noqa: E402

from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels.cpu_backend import paged_attention_cpu  # noqa: E402
from kserve_paged_kernels.cpu_native import isa  # noqa: E402
from kserve_paged_kernels.metadata import AttentionMetadata  # noqa: E402
from kserve_paged_kernels.testing import make_case  # noqa: E402

CASES = [("decode 64x600", [600] * 64, [1] * 64), ("decode 8x2048", [2048] * 8, [1] * 8),
         ("prefill 1x1024", [1024], [1024]), ("chunk 512 of 2048", [2048], [512])]
_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def load_variants(variants: list[str], tmp: Path, threads: int) -> dict[str, ctypes.CDLL]:
    """Each NAME=CHECKOUT:LEVEL built into tmp and loaded, its row kernel typed."""
    libs = {}
    for spec in variants:
        name, _, where = spec.partition("=")
        checkout, _, level = where.rpartition(":")
        lib = build(Path(checkout), isa.BY_NAME[level], tmp / f"{name}.so")
        lib.kp_paged_rows_f32.restype = ctypes.c_int
        lib.kp_paged_rows_f32.argtypes = [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32,
                                          _ptr, _i64, _ptr, _ptr, _ptr, _i64, _f32, _i32,
                                          _f32, _ptr, _i64]
        lib.kp_set_threads(threads)
        libs[name] = lib
    return libs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=CHECKOUT:LEVEL, e.g. old=/work/base:avx512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variant or [f"avx2={ROOT}:avx2", f"{isa.current().name}={ROOT}:"
                                f"{isa.current().name}"]
    with tempfile.TemporaryDirectory() as tmp:
        libs = load_variants(variants, Path(tmp), args.threads)
        cpu_native.usable = lambda *a: False  # the SDPA variant: the backend's torch path
        for label, seq_lens, q_lens in CASES:
            case = make_case(seq_lens, q_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                             block_size=16, seed=0)
            meta = AttentionMetadata.build(*case.args()[2:5])
            row_lens, seq_idx = meta.rows(case.query.shape[0])
            tok = torch.arange(case.query.shape[0])
            bt = meta.block_tables.int().contiguous()
            q, kv = case.query, case.kv_cache

            def native(lib, q=q, kv=kv, bt=bt, row_lens=row_lens, seq_idx=seq_idx, tok=tok,
                       scale=case.scale):
                out = torch.empty_like(q)
                rc = lib.kp_paged_rows_f32(
                    q.data_ptr(), q.stride(0), kv.data_ptr(), kv.shape[1], kv.shape[2],
                    kv.shape[3], kv.shape[4], q.shape[1], bt.data_ptr(), bt.stride(0),
                    row_lens.data_ptr(), tok.data_ptr(), seq_idx.data_ptr(), tok.numel(),
                    scale, 0, 0.0, out.data_ptr(), out.stride(0))
                assert rc == 0
                return out

            def sdpa(_lib, case=case):
                m = AttentionMetadata.build(*case.args()[2:5])
                return paged_attention_cpu(case.query, case.kv_cache, m, case.scale)

            runs = {name: (native, lib) for name, lib in libs.items()}
            runs["SDPA"] = (sdpa, None)
            want = sdpa(None)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for fn, lib in runs.values():
                torch.testing.assert_close(fn(lib), want, rtol=1e-4, atol=1e-4)  # and warm
            for _ in range(args.rounds):
                for name, (fn, lib) in runs.items():
                    t0 = time.perf_counter()
                    fn(lib)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                ts.sort()
                print(json.dumps({"case": label, "variant": name,
                                  "ms_median": round(ts[len(ts) // 2] * 1e3, 2),
                                  "ms_min": round(ts[0] * 1e3, 2),
                                  "ms_max": round(ts[-1] * 1e3, 2),
                                  "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
