"""Offline throughput of the default model on CPU with float32 KV against a quantized KV cache,
in one run, alternating (an indication: on CPU the backend dequantizes the blocks each layer
reads before its kernels, docs/quantization.md).

    python bench/probes/kv_quant_speed.py [--formats int8,fp8,auto-nostack] [--prompts 8]
                                          [--prompt 256] [--output 64] [--rounds 2]

`auto-nostack`: float32 KV on per-layer modules, the float32 engine without its one-call
native decoder stack (which a quantized cache does not take), to split the difference.

Each round serves the same batch once per configuration (random token prompts, greedy,
ignore_eos, prefix caching off, float32 weights and activations) and times `generate`. Prints
one JSON line: per configuration the best round's output tokens/s, and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from engine import LLM, SamplingParams

    names = ["auto", *args.formats.split(",")]
    llms = {}
    for n in names:  # NAME-nostack: that KV format on per-layer modules (no one-call stack)
        kv = n.removesuffix("-nostack")
        llms[n] = LLM(dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False,
                      max_model_len=1024)
        llms[n].engine.model.use_native_stack = kv == n
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)]
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    best = dict.fromkeys(names, 0.0)
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for n in names:
            start = time.perf_counter()
            llms[n].generate(prompts, params, use_tqdm=False)
            rate = args.prompts * args.output / (time.perf_counter() - start)
            best[n] = max(best[n], rate)
            loads.append(os.getloadavg()[0])
    result = {n: {"output_tok_s": round(r, 1), "vs_auto": round(r / best["auto"], 3)}
              for n, r in best.items()}
    result["loadavg"] = [round(x, 1) for x in loads]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
