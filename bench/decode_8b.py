"""Decode step time of a Llama-3-8B-shaped model against its memory floor, CUDA graphs on and
off (issue 32, item 7); `--shape smollm2` times the default model's shape the same way, for
the graphs-against-eager target at batch 1-16 (`graphs_speedup` per batch).

    python bench/decode_8b.py [--tiny] [--json] [--batches 1,16,64,256] [--shape smollm2]

Needs nothing but the repository: the model folder is a config.json (Llama 3 8B's shape) and a
word-level tokenizer built with `tokenizers` at run time; the weights are drawn at load
(`load_format="dummy"`). For each batch size, that many requests of `prompt` tokens are
prefilled, then `steps` decode steps are timed one by one with `torch.cuda.synchronize()`
before and after `engine.step()`, eagerly (`enforce_eager`) and with graphs. The floor of a
step is (weight bytes + the K/V bytes its rows read) / the measured device-to-device copy
bandwidth. The KV cache holds the largest batch's requests at their longest (no step
preempts; `engine_kwargs`). `--tiny` (and any run without CUDA, Triton interpreted, eager only)
uses a tiny shape. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True)
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2": SMOLLM2_135M}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=128)
BLOCK_SIZE = 16
SPARE_TOKENS = 2  # generated past the timed steps: no request finishes inside them


def model_folder(shape: dict, dest: Path) -> Path:
    """config.json of a Llama with `shape` and a word-level tokenizer over its vocabulary."""
    import tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{"tie_word_embeddings": False, **shape}).save_pretrained(dest)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",
                            eos_token="t1").save_pretrained(dest)
    return dest


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written)."""
    n = (1 << 28) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_batch(llm: Any, batch: int, prompt: int, steps: int, device: str) -> dict:
    """Prefill `batch` requests, then time `steps` decode steps one by one."""
    from kserve_paged_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + SPARE_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": [2 + (i + j) % 90
                                                                  for j in range(prompt)]},
                           params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "median_ms": statistics.median(times) * 1e3,
            "context_tokens": batch * (prompt + steps // 2),
            "preemptions": engine.scheduler.num_preemptions}  # so far in this run: 0


def floor_ms(model: Any, context_tokens: int, gbs: float) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * next(
        model.parameters()).element_size()
    return (weights + context_tokens * per_token) / (gbs * 1e9) * 1e3


def engine_kwargs(batches: list[int], prompt: int, steps: int, device: str,
                  graphs: bool) -> dict[str, Any]:
    """The LLM's settings for a run. The KV cache is sized to hold the largest batch's
    requests at their longest (every one of `max_model_len` tokens, in whole blocks), so no
    step preempts; a number of blocks, not bytes, so the eager run's free memory does not
    size the graphs' run either."""
    max_model_len = prompt + steps + 8
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    return dict(load_format="dummy", device=device,
                dtype="bfloat16" if device == "cuda" else "float32",
                enforce_eager=not graphs, max_num_seqs=max(batches),
                max_model_len=max_model_len, enable_prefix_caching=False,
                max_num_batched_tokens=max(2048, prompt), block_size=BLOCK_SIZE,
                num_kv_blocks=max(batches) * blocks_per_request)


def kv_cache_bytes(shape: dict, kwargs: dict[str, Any]) -> int:
    """What the run's KV cache takes, from the model's facts (reported with the run)."""
    from kserve_paged_engine.core.kv_sizing import kv_bytes_per_block

    dtype_bytes = 2 if kwargs["dtype"] == "bfloat16" else 4
    per_block = kv_bytes_per_block(shape["num_hidden_layers"], shape["num_key_value_heads"],
                                   shape["head_dim"], kwargs["block_size"], dtype_bytes)
    return kwargs["num_kv_blocks"] * per_block


def run(tiny: bool, batches: list[int], shape_name: str = "llama3-8b") -> dict:
    from kserve_paged_engine import LLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if tiny else SHAPES[shape_name]
    prompt, steps = (8, 3) if tiny else (512, 20)
    gbs = copy_bandwidth(device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "shape": "tiny" if tiny else shape_name, "copy_gbs": gbs,
                           "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(shape, Path(tmp) / "model")
        for graphs in ([False, True] if device == "cuda" else [False]):
            t0 = time.perf_counter()
            kwargs = engine_kwargs(batches, prompt, steps, device, graphs)
            out["kv_cache_gib"] = kv_cache_bytes(shape, kwargs) / 2**30
            llm = LLM(model=str(folder), **kwargs)
            ready = time.perf_counter() - t0
            rows = []
            for b in batches:
                r = time_batch(llm, b, prompt, steps, device)
                r["floor_ms"] = floor_ms(llm.engine.model, r["context_tokens"], gbs)
                r["floor_ratio"] = r["median_ms"] / r["floor_ms"]
                rows.append(r)
            out["runs"]["graphs" if graphs else "eager"] = {"ready_s": ready, "steps": rows}
            del llm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if "graphs" in out["runs"]:
        eager = {r["batch"]: r["median_ms"] for r in out["runs"]["eager"]["steps"]}
        out["graphs_speedup"] = {str(r["batch"]): eager[r["batch"]] / r["median_ms"]
                                 for r in out["runs"]["graphs"]["steps"]}
    out["ok"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    tiny = args.tiny or not torch.cuda.is_available()
    default = "1,2,4,8,16" if args.shape == "smollm2" else "1,16,64,256"
    batches = [int(b) for b in (args.batches or ("1,2" if tiny else default)).split(",")]
    print(json.dumps(run(tiny, batches, args.shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
