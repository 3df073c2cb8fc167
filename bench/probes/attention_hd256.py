"""fp32 paged attention at Gemma-3-270M's shape (head_dim 256, 4 query heads on 1 KV head): the
native kernel of two checkouts, interleaved round by round.

A probe for BENCHMARKS.md (not part of the engine). It compiles `kernels/kserve_paged_kernels/csrc` of each given
checkout for the given level (as `gemm_levels.py` does) and times `kp_paged_rows_f32` on
decode batches of 16 rows at several context lengths, on windowed (512, as Gemma's local
layers) and global layers, and on prefill runs (one prompt, every token a row), blocks of 16
in shuffled order. Every variant's answer is checked against the first's. `--layers L` cycles
through L layers' caches (from memory, as in serving, where every layer has its own cache) and
reports the time per layer. `--sdpa` adds the CPU backend's torch path (native kernels off:
block gathers and SDPA), timed on the first cache only.

    python bench/probes/attention_hd256.py --variant old=/tmp/base:avx512 \
        --variant new=.:avx512 [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
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
from attention_levels import load_variants  # noqa: E402

from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels.cpu_backend import paged_attention_cpu  # noqa: E402
from kserve_paged_kernels.cpu_native import isa  # noqa: E402
from kserve_paged_kernels.metadata import AttentionMetadata  # noqa: E402
from kserve_paged_kernels.testing import make_case  # noqa: E402

# (label, seq_lens, q_lens, window)
CASES = [(f"decode 16x{c} {w}", [c] * 16, [1] * 16, win)
         for c in (64, 256, 512, 768) for w, win in (("local", 512), ("global", 0))]
CASES += [("prefill 1x496 local", [496], [496], 512), ("prefill 1x496 global", [496], [496], 0),
          ("prefill 4x300 local", [300] * 4, [300] * 4, 512)]


def runner(case, window: int):
    """A call of one variant's kernel (or, for None, the torch path) on `case` over a cache."""
    meta = AttentionMetadata.build(*case.args()[2:5])
    row_lens, seq_idx = meta.rows(case.query.shape[0])
    tok = torch.arange(case.query.shape[0])
    bt = meta.block_tables.int().contiguous()
    q = case.query

    def run(lib, kv):
        if lib is None:  # SDPA, on the case's own cache
            m = AttentionMetadata.build(*case.args()[2:5])
            return paged_attention_cpu(q, case.kv_cache, m, case.scale, window=window or None)
        out = torch.empty_like(q)
        rc = lib.kp_paged_rows_f32(
            q.data_ptr(), q.stride(0), kv.data_ptr(), kv.shape[1], kv.shape[2], kv.shape[3],
            kv.shape[4], q.shape[1], bt.data_ptr(), bt.stride(0), row_lens.data_ptr(),
            tok.data_ptr(), seq_idx.data_ptr(), tok.numel(), case.scale, window, 0.0,
            out.data_ptr(), out.stride(0))
        assert rc == 0
        return out
    return run


def time_case(libs: dict, label: str, seq_lens, q_lens, window: int, args) -> None:
    """Check every variant against the first, then time them interleaved; one JSON line each."""
    case = make_case(seq_lens, q_lens, num_heads=4, num_kv_heads=1, head_dim=256,
                     block_size=16, seed=0)
    caches = [case.kv_cache] + [torch.randn_like(case.kv_cache) for _ in range(args.layers - 1)]
    run = runner(case, window)
    want = None
    for lib in libs.values():  # check, and warm
        got = run(lib, caches[0])
        for kv in caches[1:] if lib is not None else []:
            run(lib, kv)
        want = got if want is None else want
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            used = caches if lib is not None else caches[:1]
            t0 = time.perf_counter()
            for kv in used:
                run(lib, kv)
            times[name].append((time.perf_counter() - t0) / len(used))
    first = min(next(iter(times.values())))
    for name, ts in times.items():
        ts.sort()
        print(json.dumps({"case": label, "variant": name, "threads": args.threads,
                          "layers": args.layers, "ms_min": round(ts[0] * 1e3, 3),
                          "ms_median": round(ts[len(ts) // 2] * 1e3, 3),
                          "vs_first": round(first / ts[0], 2),
                          "load": round(os.getloadavg()[0], 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=CHECKOUT:LEVEL, e.g. old=/tmp/base:avx512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="run the cases whose label contains this")
    ap.add_argument("--layers", type=int, default=1, help="caches cycled (1: one, in cache)")
    ap.add_argument("--sdpa", action="store_true", help="time the torch path too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variant or [f"new={ROOT}:{isa.current().name}"]
    with tempfile.TemporaryDirectory() as tmp:
        libs = load_variants(variants, Path(tmp), args.threads)
        if args.sdpa:
            cpu_native.usable = lambda *a: False  # the torch path of the backend
            libs["SDPA"] = None
        for label, seq_lens, q_lens, window in CASES:
            if args.only in label:
                time_case(libs, label, seq_lens, q_lens, window, args)


if __name__ == "__main__":
    main()
