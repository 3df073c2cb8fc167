"""One stream at a time, offline: TPOT (time per output token after the first) and resident
weight bytes of the default model served from its GGUF, float32 and bfloat16 (dequantized)
against `--quantization gguf` (Q4_1 kept as int4, the Q8_0 embedding and head as int8 g32, float32
activations), in one run, alternating.

    python bench/probes/quant_tpot.py [--prompt 256] [--output 128] [--rounds 3]

Each round runs each configuration once: a 256-token random prompt, 128 greedy tokens,
ignore_eos; the engine's step times are recorded, TPOT is the median decode step. Prints one
JSON line per configuration with the median TPOT over rounds, the weights' bytes and loadavg.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def weight_bytes(model: object) -> int:
    """Bytes of the parameters plus the packed quantized projections (ties counted once)."""
    from engine.model_executor.layers import Linear

    seen, total = set(), 0
    for p in model.parameters():  # type: ignore[attr-defined]
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.nbytes
    for m in model.modules():  # type: ignore[attr-defined]
        if isinstance(m, Linear) and m.quant is not None:
            total += m.quant.nbytes()
    return total


def run_once(llm: object, prompt: list[int], output: int) -> float:
    from engine import SamplingParams

    engine = llm.engine  # type: ignore[attr-defined]
    times: list[float] = []
    step = engine.step

    def timed() -> object:
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out

    engine.step = timed
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output,  # type: ignore[attr-defined]
                                              ignore_eos=True), use_tqdm=False)
    finally:
        engine.step = step
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--configs", nargs="+", default=None, help="a subset, by name prefix")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.default_model import ensure_default_model, find_gguf

    ensure_default_model()
    gguf = find_gguf()
    assert gguf is not None
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
    configs = {"float32 (dequantized)": ("float32", None),
               "bfloat16 (dequantized)": ("bfloat16", None),
               "int4 (--quantization gguf, float32 activations)": ("float32", "gguf")}
    configs = {k: v for k, v in configs.items()
               if not args.configs or any(k.startswith(c) for c in args.configs)}
    llms = {name: LLM(model=str(gguf), dtype=dtype, quantization=q, max_model_len=1024,
                      num_kv_blocks=128, enable_prefix_caching=False)
            for name, (dtype, q) in configs.items()}
    tpot: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            tpot[name].append(run_once(llm, prompt, args.output))
    for name, llm in llms.items():
        print(json.dumps({"config": name, "tpot_ms_median": 1000 * statistics.median(tpot[name]),
                          "tpot_ms_rounds": [round(1000 * t, 2) for t in tpot[name]],
                          "weight_mib": weight_bytes(llm.engine.model) / 2**20,
                          "gguf_mib": gguf.stat().st_size / 2**20,
                          "loadavg": os.getloadavg(), "prompt": args.prompt,
                          "threads": __import__("torch").get_num_threads(),
                          "output": args.output}))


if __name__ == "__main__":
    main()
