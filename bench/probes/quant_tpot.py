"""One stream at a time, offline: TPOT (time per output token after the first) and resident
weight bytes of the default model served from its GGUF, float32 and bfloat16 (dequantized)
against `--quantization gguf` (Q4_1 kept as int4, the Q8_0 embedding and head as int8 g32, float32
activations; and with bfloat16 activations, what the default runs where `--dtype auto` is
bfloat16), and the float folder with `--quantization fp8` (e4m3 at one byte on the native
kernel) and `int8`, in one run, alternating.

    python bench/probes/quant_tpot.py [--prompt 256] [--output 128] [--rounds 3] [--threads N]
        [--configs float32 int4 int4-bf16] [--llamacpp]

Each round runs each configuration once: a 256-token random prompt, 128 greedy tokens,
ignore_eos; the engine's step times are recorded, TPOT is the median decode step. With
`--llamacpp`, llama.cpp's llama-server (bench/peers/llamacpp_tpot.py) serves the same GGUF in
the same rounds, timed by its own per-token decode timing. Prints one
JSON line per configuration with the median TPOT over rounds, the weights' bytes and loadavg.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.peers too


def weight_bytes(model: object) -> int:
    """Bytes of the parameters plus the packed quantized projections (ties counted once)."""
    from kserve_paged_engine.model_executor.layers import Linear

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
    from kserve_paged_engine import SamplingParams

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


def _configs(gguf: Path, folder: Path) -> dict[str, tuple[Path, str, str | None]]:
    """name -> (model, dtype, quantization); `folder` holds the GGUF's weights as float."""
    return {"float32 (dequantized)": (gguf, "float32", None),
            "bfloat16 (dequantized)": (gguf, "bfloat16", None),
            "int4 (--quantization gguf, float32 activations)": (gguf, "float32", "gguf"),
            "int4-bf16 (--quantization gguf, bfloat16 activations)": (gguf, "bfloat16", "gguf"),
            "fp8 (--quantization fp8, float32 activations)": (folder, "float32", "fp8"),
            "int8 (--quantization int8, float32 activations)": (folder, "float32", "int8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--configs", nargs="+", default=None, help="a subset, by name prefix")
    ap.add_argument("--llamacpp", action="store_true",
                    help="llama.cpp's llama-server on the same Q4_1 file, in the same rounds")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from kserve_paged_engine import LLM
    from kserve_paged_engine.frontend import default_model

    default_model.ensure_default_model()
    gguf = default_model.find_gguf()
    assert gguf is not None
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
    configs = {k: v for k, v in _configs(gguf, default_model.default_model_dir()).items()
               if not args.configs or any(k.startswith(c) for c in args.configs)}
    llms = {name: LLM(model=str(model), dtype=dtype, quantization=q, max_model_len=1024,
                      num_kv_blocks=128, enable_prefix_caching=False)
            for name, (model, dtype, q) in configs.items()}
    tpot: dict[str, list[float]] = {name: [] for name in [*configs, "llama.cpp"]}
    with contextlib.ExitStack() as stack:
        peer = None
        if args.llamacpp:
            from bench.peers import llamacpp_tpot

            if llamacpp_tpot.available():
                import torch

                peer = stack.enter_context(llamacpp_tpot.LlamaServer(
                    gguf, threads=torch.get_num_threads()))
            else:
                print(f"no llama-server in {llamacpp_tpot.DIR}: llama.cpp not measured")
        for _ in range(args.rounds):
            for name, llm in llms.items():
                tpot[name].append(run_once(llm, prompt, args.output))
            if peer is not None:
                tpot["llama.cpp"].append(peer.tpot_s(prompt, args.output))
    if tpot["llama.cpp"]:
        print(json.dumps({"config": "llama.cpp (llama-server, same Q4_1 file)",
                          "tpot_ms_median": 1000 * statistics.median(tpot["llama.cpp"]),
                          "tpot_ms_rounds": [round(1000 * t, 2) for t in tpot["llama.cpp"]]}))
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
