"""W1 twice through the engine on a Llama-3-8B-shaped model, and transformers on the same GPU
for the ratio (issue 32, item 7; issue 7's GPU run without the default model's files).

    python bench/w1_8b.py [--tiny] [--json] [--num-prompts N] [--max-tokens N] [--no-peer]

Needs nothing but the repository: the model folder is bench/decode_8b.py's (Llama 3 8B's
config and a word-level tokenizer built with `tokenizers`), the weights are drawn at load
(`load_format="dummy"`), W1 is bench/workloads/workload_random.json (token ids, greedy,
`ignore_eos`, so the weights' values do not change the work). The engine (bfloat16 on CUDA,
its default backend there and CUDA graphs; prefix caching off, so both passes do the same
work) runs W1 twice: the first pass meets whatever the warm-up left cold, the second is the
figure. Both must return every requested token; whether the second pass's tokens equal the
first's is recorded (greedy over the same weights: they should). transformers `generate`
(left-padded static batches of 16, bench/peers/hf_offline.py) runs W1 once on the same model
shape for the ratio. `--tiny` (and any run without CUDA: Triton interpreted, float32) uses the
tiny shape (with W1's vocabulary), W1's first 3 requests cut to 16 prompt
tokens and 6 output tokens each. The last stdout line is JSON; with the peer, the engine's
figures are printed as a JSON line (`"partial"`) before the peer starts, so a peer killed at a
time limit leaves them as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from benchlib import load_workload  # noqa: E402
from decode_8b import LLAMA3_8B, TINY, model_folder  # noqa: E402

KV_BYTES = 16 << 30  # W1 peaks near 27.5k tokens: 3.5 GB for the 8B shape in bf16
PEER_BATCH = 16
TINY_W1 = {**TINY, "vocab_size": 49152, "max_position_embeddings": 1024}  # W1 fits


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()




def run_engine(folder: Path, reqs: list[dict], device: str, dtype: str) -> dict[str, Any]:
    from kserve_paged_engine import LLM, SamplingParams

    t0 = time.perf_counter()
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    llm = LLM(model=str(folder), load_format="dummy", device=device, dtype=dtype,
              max_model_len=longest, enable_prefix_caching=False,
              kv_cache_memory=KV_BYTES if device == "cuda" else 64 << 20)
    out: dict[str, Any] = {"ready_s": round(time.perf_counter() - t0, 2), "passes": []}
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    tokens = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate([r["prompt_token_ids"] for r in reqs], params, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - t0
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        n = sum(len(t) for t in tokens[-1])
        out["passes"].append({"seconds": round(seconds, 3), "output_tokens": n,
                              "output_tok_s": n / seconds, "requests_s": len(reqs) / seconds})
    out["complete"] = all(len(t) == r["max_tokens"] for run in tokens
                          for t, r in zip(run, reqs))
    out["same_tokens_both_passes"] = tokens[0] == tokens[1]
    graphs = llm.engine.runner.graphs
    out["graph_replays"] = sum(graphs.used.values()) if graphs is not None else 0
    del llm
    return out


def run_peer(folder: Path, reqs: list[dict], device: str, dtype: str) -> dict[str, Any]:
    """transformers on the same shape with random weights, built on the device."""
    from hf_offline import run_static
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    res = run_static(model, reqs, PEER_BATCH, pad_id=0)
    asked = sum(r["max_tokens"] for r in reqs)
    del model
    return {**res, "output_tokens": asked, "output_tok_s": asked / res["seconds"]}


def emit(result: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed at once (a later kill must not lose it)."""
    print(json.dumps(result), flush=True)


def run(tiny: bool, peer: bool, num_prompts: int | None = None,
        max_tokens: int | None = None,
        partial: Callable[[dict[str, Any]], None] = emit) -> dict[str, Any]:
    """W1 through the engine, then the peer. The engine's figures go to `partial` before the
    peer starts, so a peer that overruns its time (and is killed) or fails loses only its
    own; a peer's exception is recorded, not raised."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = tiny or device == "cpu"
    shape = TINY_W1 if tiny else LLAMA3_8B
    dtype = "bfloat16" if device == "cuda" else "float32"
    reqs = load_workload("random", num_prompts or (3 if tiny else None),
                         max_tokens or (6 if tiny else None))
    if tiny:  # interpreted prefill costs a fraction of a second per row: 16 tokens a prompt
        reqs = [{**r, "prompt_token_ids": r["prompt_token_ids"][:16]} for r in reqs]
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda"
                           else "cpu (Triton interpreted)", "shape": "tiny" if tiny
                           else "llama3-8b", "dtype": dtype, "requests": len(reqs),
                           "asked_tokens": sum(r["max_tokens"] for r in reqs)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(shape, Path(tmp) / "model")
        out["engine"] = run_engine(folder, reqs, device, dtype)
        out["ok"] = out["engine"]["complete"]
        _release(device)
        if peer:
            partial({**out, "partial": "the transformers peer runs next"})
            try:
                out["transformers"] = run_peer(folder, reqs, device, dtype)
            except Exception as exc:  # noqa: BLE001 - the engine's figures stand without it
                out["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                out["ratio"] = (out["engine"]["passes"][1]["output_tok_s"]
                                / out["transformers"]["output_tok_s"])
            _release(device)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="no transformers run")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="only JSON lines on stdout (the last: the result)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    result = run(args.tiny, not args.no_peer, args.num_prompts, args.max_tokens)
    if not args.json:
        eng = result["engine"]
        for i, p in enumerate(eng["passes"], 1):
            print(f"engine pass {i}: {p['output_tok_s']:.1f} out tok/s in {p['seconds']} s")
        if "ratio" in result:
            print(f"transformers: {result['transformers']['output_tok_s']:.1f} out tok/s; "
                  f"ratio {result['ratio']:.2f}")
        elif "transformers" in result:
            print(f"transformers failed: {result['transformers']['error']}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
