"""Offline decode speed of the default model on CPU with a float KV cache against a quantized
one, in one run, alternating (ratios; the machine's load moves absolute figures).

    python bench/probes/kv_quant_speed.py [--configs float32:auto,float32:int8,...]
                                          [--prompts 4] [--prompt 128] [--output 32]
                                          [--rounds 2]

A config is `DTYPE:KV[-nostack|-torch]`: the model dtype (float32, bfloat16), the
--kv-cache-dtype, and `-nostack` for the per-layer modules instead of the one-call native
decoder stack, or `-torch` for a quantized cache's PyTorch path (the store and dequantize-then-
attend, per-layer modules: what served before the native kernels), patched in around that
configuration's calls only. `--threads N` sets torch's (and the native library's) threads.

Each round serves the same batch once per configuration twice: with one output token (the
prefill) and with `--output` tokens (random token prompts, greedy, ignore_eos, prefix caching
off). TPOT is (full - prefill) / (output - 1), decode throughput prompts / TPOT. Prints one
JSON line: per configuration the best round's TPOT (ms) and output tokens/s, each against the
first configuration, and load averages.
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

DEFAULT = "float32:auto,float32:int8,float32:fp8,float32:fp8_e5m2,bfloat16:auto,bfloat16:int8"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)

    names = args.configs.split(",")
    llms = {}
    for n in names:
        dtype, kv = n.split(":")
        llms[n] = LLM(dtype=dtype, kv_cache_dtype=kv.split("-")[0],
                      enable_prefix_caching=False, max_model_len=1024)
        llms[n].engine.model.use_native_stack = "-" not in kv
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)]
               for _ in range(args.prompts)]
    full = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tpot = dict.fromkeys(names, float("inf"))
    rate = dict.fromkeys(names, 0.0)
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for n in names:
            undo = _torch_path() if n.endswith("-torch") else None
            start = time.perf_counter()
            llms[n].generate(prompts, first, use_tqdm=False)
            mid = time.perf_counter()
            llms[n].generate(prompts, full, use_tqdm=False)
            end = time.perf_counter()
            if undo:
                undo()
            step = ((end - mid) - (mid - start)) / (args.output - 1)
            tpot[n] = min(tpot[n], step)
            rate[n] = max(rate[n], args.prompts * args.output / (end - mid))
            loads.append(os.getloadavg()[0])
    base = names[0]
    result = {n: {"tpot_ms": round(tpot[n] * 1e3, 1), "tpot_vs_first": round(tpot[n] / tpot[base], 3),
                  "decode_tok_s": round(args.prompts / tpot[n], 1),
                  "output_tok_s": round(rate[n], 1), "vs_first": round(rate[n] / rate[base], 3)}
              for n in names}
    result["loadavg"] = [round(x, 1) for x in loads]
    print(json.dumps(result))
    return 0


def _torch_path():  # noqa: ANN202
    """Route a quantized cache through PyTorch (store, dequantize); returns the undo."""
    import kserve_paged_kernels.cpu_kvq as cpu_kvq
    import kserve_paged_kernels.dispatch as dispatch

    saved = (dispatch.cpu_native.store_kv_q8, cpu_kvq.cpu_native.kvq_usable)
    dispatch.cpu_native.store_kv_q8 = lambda *a, **k: None
    cpu_kvq.cpu_native.kvq_usable = lambda *a, **k: False

    def undo() -> None:
        dispatch.cpu_native.store_kv_q8, cpu_kvq.cpu_native.kvq_usable = saved
    return undo


if __name__ == "__main__":
    sys.exit(main())
