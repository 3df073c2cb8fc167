"""Whole offline runs with the native decoder stack on and off, in one process.

A probe for BENCHMARKS.md (not part of the engine): builds the engine as bench_offline.py does
(tcmalloc, max_model_len 2048, prefix cache off), then generates W1's first N requests
(greedy, ignore_eos) again and again, the model's `use_native_stack` alternating, so both paths
see the same weights, caches and host drift. Per run: the wall time and the forward time of
the prefill-sized steps (more than 64 rows) and of the decode steps, split at the model
runner's `forward`. Greedy tokens are compared between the two paths (they must be equal: the
stack computes what the per-layer modules do, bit for bit).

    python bench/probes/stack_ab.py --model ~/.cache/kserve-paged/models/gemma-3-270m \
        --dtype float32 [--num-prompts 16] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    from benchlib import load_workload, timed_steps, warmup_prompts

    from kserve_paged_engine import LLM, SamplingParams

    steps = timed_steps()
    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=2048)
    model = llm.engine.model
    print(f"model {model.architecture}, dtype {args.dtype}, stack: "
          f"{'built' if model.native_stack is not None else model.native_stack_declined}")
    if model.native_stack is None:
        return
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(args.rounds):
        for use in (True, False):
            model.use_native_stack = use
            steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens[use] = [list(o.outputs[0].token_ids) for o in outs]
            prefill = sum(s for n, s in steps if n > 64)
            decode = sum(s for n, s in steps if n <= 64)
            runs[use].append((wall, prefill, decode))
            print(f"stack {'on ' if use else 'off'}: wall {wall:.3f} s, prefill steps "
                  f"{prefill:.3f} s, decode steps {decode:.3f} s", flush=True)
    _report(runs)
    print("greedy tokens equal:", tokens[True] == tokens[False])


def _report(runs: dict[bool, list[tuple[float, float, float]]]) -> None:
    """Best and median of (wall, prefill steps, decode steps) per path."""
    for use in (True, False):
        best = [min(r[i] for r in runs[use]) for i in range(3)]
        med = [sorted(r[i] for r in runs[use])[len(runs[use]) // 2] for i in range(3)]
        print(f"stack {'on ' if use else 'off'} best  wall/prefill/decode "
              f"{best[0]:.3f} / {best[1]:.3f} / {best[2]:.3f} s; median "
              f"{med[0]:.3f} / {med[1]:.3f} / {med[2]:.3f} s")


if __name__ == "__main__":
    main()
