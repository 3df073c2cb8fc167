"""One decode step of the default model at the model level (no engine), float against
`--quantization gguf`, in a chosen dtype: a 128-token prefill, then the median time of 32
single-token decode steps, each configuration in the same run.

    python bench/probes/quant_step.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_engine.frontend.default_model import find_gguf  # noqa: E402
from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402


def decode_ms(model: torch.nn.Module, steps: int = 32) -> float:
    sim = PagedSim(model, seed=0, num_blocks=256)
    dtype = model.model.norm.weight.dtype
    sim.kv = [kv.to(dtype) for kv in sim.kv]  # the cache in the model's dtype
    logits = sim.step([(0, list(range(100, 228)))])
    times = []
    for _ in range(steps):
        token = int(logits[-1].argmax())
        t0 = time.perf_counter()
        logits = sim.step([(0, [token])])
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    dtype = getattr(torch, ap.parse_args().dtype)
    gguf = find_gguf()
    assert gguf is not None
    for quantization in (None, "gguf"):
        model, _ = load_model(gguf, dtype, torch.device("cpu"), quantization=quantization)
        print(f"{dtype} quantization={quantization}: decode step {decode_ms(model):.1f} ms "
              f"(loadavg {os.getloadavg()})", flush=True)
        del model


if __name__ == "__main__":
    main()
