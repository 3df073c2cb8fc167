"""Tensor parallelism on CPU: TP = 2 x 1 thread against TP = 1 x 2 threads on one workload, in
one process and one run, with the all-reduce time per step (the correctness path's overhead;
on 2 cores no speed-up is expected).

Greedy, ignore_eos, all requests at once, a short warm-up first. Each configuration is a fresh
engine; TP = 2 spawns one worker (gloo) whose rank 0 and worker each take 1 of the 2 threads.

    python bench/bench_tp.py --num-prompts 32 --max-tokens 128 --json-out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import WORKLOAD_NAMES, load_workload, warmup_prompts  # noqa: E402


def run(tp: int, threads: int, reqs: list[dict], args: argparse.Namespace,
        expert_parallel: bool = False) -> dict:
    """One configuration; `expert_parallel`: a MoE model's experts spread over the ranks
    (bench/bench_ep.py), its all-to-all time reported beside the all-reduce's."""
    import torch

    from kserve_paged_engine import LLM, SamplingParams

    torch.set_num_threads(threads)  # TP = 2: the pool divides them between the ranks
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=2048, tensor_parallel_size=tp,
              enable_expert_parallel=expert_parallel,
              quantization=getattr(args, "quantization", None))
    init = time.perf_counter() - t0
    engine = llm.engine
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    group = engine.model.tp
    if group is not None:
        group.take_reduce_seconds()
        group.take_exchange_seconds()
    steps = 0
    step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    reduce_s, reduces = group.take_reduce_seconds() if group is not None else (0.0, 0)
    a2a_s, a2as = group.take_exchange_seconds() if group is not None else (0.0, 0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tensor_parallel_size": tp, "threads_per_rank": torch.get_num_threads(),
              "init_seconds": init, "seconds": seconds, "steps": steps, "output_tokens": n_out,
              "output_tok_s": n_out / seconds, "tokens": [o.outputs[0].token_ids for o in outs],
              "all_reduce_seconds": reduce_s, "all_reduces": reduces,
              "all_reduce_ms_per_step": 1e3 * reduce_s / steps if steps else 0.0,
              "all_reduce_share": reduce_s / seconds, "expert_parallel": expert_parallel,
              "all_to_all_seconds": a2a_s, "all_to_alls": a2as,
              "all_to_all_ms_per_step": 1e3 * a2a_s / steps if steps else 0.0}
    llm.engine.close()
    print(f"TP={tp} x {result['threads_per_rank']} thread(s): {seconds:.1f} s, "
          f"{result['output_tok_s']:.1f} output tok/s, {steps} steps, all-reduce "
          f"{result['all_reduce_ms_per_step']:.2f} ms/step ({100 * result['all_reduce_share']:.1f}%"
          f" of the run, {reduces} calls)"
          + (f", all-to-all {result['all_to_all_ms_per_step']:.2f} ms/step ({a2as} calls)"
             if a2as else "")
          + (" [expert parallel]" if expert_parallel else ""), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    ap.add_argument("--model", default=None, help="local HF folder (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--quantization", default=None,
                    help="the engine's --quantization: gguf serves the default model 4-bit")
    ap.add_argument("--single-thread-peer", action="store_true",
                    help="also run TP = 1 on one thread")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the server does
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    load = os.getloadavg()
    one = run(1, 2, reqs, args)
    # TP = 1 on one thread too: the same per-rank threads as TP = 2, so the ratio to it is the
    # cost of sharding alone, apart from how two OpenMP threads fare on this machine.
    single = run(1, 1, reqs, args) if args.single_thread_peer else None
    two = run(2, 2, reqs, args)
    tokens = one.pop("tokens")
    same = tokens == two.pop("tokens") and (single is None or single.pop("tokens") == tokens)
    ratio = two["output_tok_s"] / one["output_tok_s"]
    print(f"TP=2x1 / TP=1x2 output tok/s: {ratio:.2f}; same greedy tokens: {same}; load "
          f"average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    if single is not None:
        print(f"TP=2x1 / TP=1x1 output tok/s: "
              f"{two['output_tok_s'] / single['output_tok_s']:.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({
            "workload": args.workload, "num_prompts": len(reqs), "max_tokens": args.max_tokens,
            "dtype": args.dtype, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_start": load, "load_average_end": os.getloadavg(),
            "same_greedy_tokens": same, "ratio_tp2_over_tp1": ratio,
            "ratio_tp2_over_tp1_single_thread": (two["output_tok_s"] / single["output_tok_s"]
                                                 if single is not None else None),
            "runs": [r for r in (one, single, two) if r is not None]}, indent=2))


if __name__ == "__main__":
    main()
