"""Which CPU attention path serves W1 best on this machine: the native row kernel for every
row, the row kernel for decode rows with SDPA for prefill (kernels/kserve_paged_kernels/cpu_backend.py's routing
without the AVX-512 prefill tiles), or SDPA for everything.

A probe for BENCHMARKS.md (not part of the engine). One engine per run, the default model in
float32, prefix caching off, W1's first requests, greedy with ignore_eos, best of 2.

    python bench/probes/attention_routing.py {rows|split|torch} [--max-num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import load_workload, warmup_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("rows", "split", "torch"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from kserve_paged_kernels import cpu_native

    if args.mode == "torch":
        cpu_native.usable = lambda *a: False
    else:
        cpu_native.prefill_tiles = lambda: args.mode == "rows"
    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    base = ensure_default_model(progress=lambda _: None)
    llm = LLM(model=str(base), dtype="float32", enable_prefix_caching=False, max_model_len=2048,
              max_num_seqs=args.max_num_seqs)
    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"mode": args.mode, "max_num_seqs": args.max_num_seqs,
                      "prompt_tokens": sum(map(len, prompts)), "output_tokens": n_out,
                      "seconds": round(best, 2), "output_tok_s": round(n_out / best, 1),
                      "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
