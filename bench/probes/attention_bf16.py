"""bf16 attention on CPU: the native bf16-KV kernel against the SDPA path, fp32 beside.

A probe for BENCHMARKS.md (not part of the engine). One attention layer of SmolLM2's shape (9
query heads over 3 KV heads of 64, blocks of 16 in shuffled order) through the CPU backend:
bf16 with the native kernel (`kp_paged_rows_bf16`: the row kernel for decode rows, the
transposed-key tiles for prefill runs), bf16 with the native library off (gather + SDPA, what
bf16 decode ran before the row kernel and bf16 prefill before the tiles), and fp32 native;
interleaved round by round, median (min-max) in ms. `KSERVE_PAGED_ISA` picks the level as for
the engine. `--only prefill` / `decode` picks the cases. `--heads Q,KV` and `--window W` set
the layer (Gemma-3-270M's local layers: `--heads 4,1 --head-dim 256 --window 512`); "bf16
rows" sends every prefill row to the native row kernel too, whatever the backend's rule.

    python bench/probes/attention_bf16.py [--threads N] [--rounds R] [--head-dim D] [--only K]
        [--heads Q,KV] [--window W]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_kernels import cpu_backend, cpu_native  # noqa: E402
from kserve_paged_kernels.cpu_backend import paged_attention_cpu  # noqa: E402
from kserve_paged_kernels.cpu_native import loader  # noqa: E402
from kserve_paged_kernels.metadata import AttentionMetadata  # noqa: E402
from kserve_paged_kernels.testing import make_case  # noqa: E402

W1_STEP = [512, 400, 300, 200, 100, 64, 472]  # 7 prompts, as bench/probes/prefill_attention.py
CASES = [("decode 64x600", [600] * 64, [1] * 64), ("decode 8x2048", [2048] * 8, [1] * 8),
         ("decode 1x4096", [4096], [1]),
         ("prefill W1 step", W1_STEP, W1_STEP),
         ("prefill 1x2048", [2048], [2048]), ("prefill 8x64", [64] * 8, [64] * 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--only", choices=("decode", "prefill"))
    ap.add_argument("--heads", default="9,3", help="query heads,KV heads")
    ap.add_argument("--window", type=int, default=None)
    args = ap.parse_args()
    heads, kv_heads = (int(h) for h in args.heads.split(","))
    real_prefill_native = cpu_backend._prefill_native
    torch.set_num_threads(args.threads)
    assert cpu_native.load() is not None
    real_usable = cpu_native.usable
    results: dict[str, dict[str, list[float]]] = {}
    for name, seq_lens, q_lens in CASES:
        if args.only and not name.startswith(args.only):
            continue
        cases = {dt: make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=args.head_dim, dtype=dt, seed=1)
                 for dt in (torch.float32, torch.bfloat16)}
        variants = {"bf16 native": (torch.bfloat16, True), "bf16 SDPA": (torch.bfloat16, False),
                    "bf16 rows": (torch.bfloat16, "rows"), "fp32 native": (torch.float32, True)}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, (dt, native) in variants.items():
                case = cases[dt]
                cpu_native.usable = real_usable if native else (lambda *a: False)
                cpu_backend._prefill_native = (
                    (lambda q, shaped: True) if native == "rows" else real_prefill_native)
                meta = AttentionMetadata.build(*case.args()[2:5])
                run = lambda case=case, meta=meta: paged_attention_cpu(  # noqa: E731
                    case.query, case.kv_cache, meta, case.scale, window=args.window)
                run()  # warm, plan
                t0 = time.perf_counter()
                for _ in range(5):
                    run()
                times[v].append((time.perf_counter() - t0) / 5 * 1e3)
        cpu_native.usable = real_usable
        cpu_backend._prefill_native = real_prefill_native
        results[name] = times
        row = ", ".join(f"{v} {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"
                        for v, t in times.items())
        print(f"{name}: {row}", flush=True)
    print(json.dumps({"level": loader.loaded_level().name, "threads": args.threads,
                      "head_dim": args.head_dim, "heads": [heads, kv_heads],
                      "window": args.window, "ms": results}))


if __name__ == "__main__":
    main()
