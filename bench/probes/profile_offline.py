"""Where an offline run's time goes: torch.profiler over the first N requests of a workload.

A probe for BENCHMARKS.md (not part of the engine). Builds the engine as bench_offline.py does,
warms it up, then generates N requests of W1 or W2 (greedy, ignore_eos) under torch.profiler
and prints the ops by self CPU time (the native kernels are called through ctypes, so they
appear as the time of the record_function around nothing: their share is what is not listed
under an ATen op; the total is the wall time of the run).

    python bench/probes/profile_offline.py --dtype bfloat16 [--workload random]
        [--num-prompts 16] [--max-tokens 64] [--threads N] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from benchlib import load_workload, warmup_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workload", default="random", choices=("random", "shared"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kserve_paged_engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    llm = LLM(dtype=args.dtype, enable_prefix_caching=args.workload == "shared",
              max_model_len=2048)
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    listed = sum(e.self_cpu_time_total for e in events) / 1e6
    rows = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count,
             "share_of_wall": e.self_cpu_time_total / 1e6 / wall} for e in events[:args.top]]
    print(f"dtype {args.dtype} ({llm.engine.dtype}), {len(reqs)} requests of "
          f"{args.workload}, wall {wall:.2f} s, ATen ops {listed:.2f} s; the rest is Python, "
          f"the native kernels (ctypes) and waits")
    for r in rows:
        print(f"  {r['share_of_wall'] * 100:5.1f}%  {r['self_s']:7.3f} s  {r['calls']:7d}  {r['op']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"dtype": args.dtype, "wall_s": wall,
                                                   "aten_s": listed, "top": rows}, indent=2))


if __name__ == "__main__":
    main()
