"""GPU run of issue 7: our engine on CUDA over W1, next to transformers on the same GPU.

    python bench/gpu_engine.py [--out PATH] [--models default,llama3-8b] [--skip-hf]
                               [--num-prompts N] [--max-tokens N] [--dry-run]

Models:
- `default`: the default model (SmolLM2-135M-Instruct, the converted folder), its own weights.
- `llama3-8b`: Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128,
  intermediate 14336, vocabulary 128256) with weights drawn at start (`load_format="dummy"`)
  and the default model's tokenizer: W1 is token ids with `ignore_eos`, so the values of the
  weights do not matter for throughput (ids past the tokenizer's vocabulary decode to nothing).

For each model: the engine (bfloat16, the Triton/flash-attn backend the engine picks on CUDA)
runs W1 once after a warm-up and reports output tokens/s; every pure-decode step is timed and
set against its memory floor, (bytes of weights + K/V read that step) / the measured
device-to-device copy bandwidth. transformers `generate` (left-padded static batches of 16,
as bench/peers/hf_offline.py) runs the same requests on the same GPU for the ratio. JSON goes to
--out (default $OUT/gpu_engine.json when OUT is set) and a markdown table is printed.
`--dry-run` does it all on CPU with a tiny shape and 4 short requests (float32), to check the
plumbing without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
             "tie_word_embeddings": False}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152,
        "tie_word_embeddings": False}
ROW_BUCKETS = ((1, 1), (2, 16), (17, 64), (65, 1 << 30))
KV_BYTES = 16 << 30


def release(device: str) -> None:
    """Give a finished run's GPU memory back before the next model loads."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "gpu_engine.json") if os.environ.get("OUT") \
        else None
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--models", default="default,llama3-8b")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, 4 short requests")
    return ap.parse_args(argv)


def shaped_folder(default_dir: Path, shape: dict, dest: Path) -> Path:
    """A model folder with the default model's config and tokenizer, resized to `shape`."""
    config = json.loads((default_dir / "config.json").read_text())
    config.update(shape)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, dest / name)
    return dest


def decode_floor(model, rows: int, context_tokens: int, copy_gbs: float) -> tuple[int, float]:
    """Bytes a decode step must read (weights once + every row's K/V) and that time in ms."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * next(
        model.parameters()).element_size()
    nbytes = weights + context_tokens * per_token
    return nbytes, nbytes / (copy_gbs * 1e9) * 1e3


def run_engine(path: Path, load_format: str, reqs: list[dict], device: str, dtype: str,
               copy_gbs: float) -> dict:
    import torch

    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    # A fixed KV budget (W1 peaks at ~27.5k tokens: 3.5 GB for the 8B shape in bf16), so the
    # engine does not take most of the GPU and leave transformers nothing.
    llm = LLM(model=str(path), load_format=load_format, dtype=dtype, device=device,
              max_model_len=2048, enable_prefix_caching=False,
              kv_cache_memory=KV_BYTES if device == "cuda" else 64 << 20)
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    steps: list[tuple[int, int, float]] = []  # (rows, context tokens, seconds), decode only
    execute = runner.execute

    def timed(out):
        start = time.perf_counter()
        result = execute(out)  # returns host-side tokens: the step is finished
        seconds = time.perf_counter() - start
        n = sum(out.num_scheduled_tokens.values())
        if n == len(out.scheduled):
            ctx = sum(r.num_computed_tokens + 1 for r in out.scheduled)
            steps.append((n, ctx, seconds))
        return result

    warm = [[5] * 64] * 4
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    runner.execute = timed
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    buckets = []
    for lo, hi in ROW_BUCKETS:
        sel = [s for s in steps if lo <= s[0] <= hi]
        if not sel:
            continue
        ms = statistics.median(s[2] for s in sel) * 1e3
        rows = statistics.median(s[0] for s in sel)
        ctx = int(statistics.median(s[1] for s in sel))
        nbytes, floor_ms = decode_floor(runner.model, int(rows), ctx, copy_gbs)
        buckets.append({"rows": f"{lo}-{hi}" if hi < 1 << 30 else f">={lo}", "steps": len(sel),
                        "median_ms": ms, "median_rows": rows, "median_context_tokens": ctx,
                        "floor_bytes": nbytes, "floor_ms": floor_ms, "floor_ratio": floor_ms / ms})
    return {"load_seconds": load_s, "seconds": seconds, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / seconds, "decode_steps": buckets}


def run_hf(path: Path, dummy: bool, reqs: list[dict], device: str, dtype: str) -> dict:
    import torch
    from hf_offline import run_static
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if dummy:  # the same shape, random weights, built on the device
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch_dtype).to(device)
    model.eval()
    res = run_static(model, reqs, 16, pad_id=0)
    asked = sum(r["max_tokens"] for r in reqs)
    return {**res, "output_tokens": asked, "output_tok_s": asked / res["seconds"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from benchlib import load_workload
    from gpu_check import copy_bandwidth, make_timer

    from engine.default_model import ensure_default_model

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run to check the plumbing on CPU", file=sys.stderr)
        return 2
    dtype = "float32" if args.dry_run else "bfloat16"
    num_prompts = args.num_prompts or (4 if args.dry_run else None)
    max_tokens = args.max_tokens or (8 if args.dry_run else None)
    reqs = load_workload("random")[:num_prompts]
    if max_tokens:
        reqs = [{**r, "max_tokens": min(r["max_tokens"], max_tokens)} for r in reqs]
    copy_gbs = copy_bandwidth(device, make_timer(device), (1 << 30) if device == "cuda"
                              else (64 << 20))
    default_dir = Path(ensure_default_model(progress=lambda _: None))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device,
              "device_name": torch.cuda.get_device_name(0) if device == "cuda"
              else platform.processor() or platform.machine(),
              "dtype": dtype, "copy_gbs": copy_gbs, "requests": len(reqs), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name == "default":
                path, dummy = default_dir, False
            elif name == "llama3-8b":
                path = shaped_folder(default_dir, TINY if args.dry_run else LLAMA3_8B,
                                     Path(tmp) / name)
                dummy = True
            else:
                print(f"unknown model {name!r} (default, llama3-8b)", file=sys.stderr)
                return 2
            entry = {"engine": run_engine(path, "dummy" if dummy else "auto", reqs, device,
                                          dtype, copy_gbs)}
            release(device)  # after the return: the run's frame held the engine until then
            if not args.skip_hf:
                entry["transformers"] = run_hf(path, dummy, reqs, device, dtype)
                release(device)
                entry["ratio"] = (entry["engine"]["output_tok_s"]
                                  / entry["transformers"]["output_tok_s"])
            result["models"][name] = entry
    print(markdown(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def markdown(result: dict) -> str:
    lines = [f"{result['date']}, {result['device_name']}, {result['dtype']}, "
             f"copy {result['copy_gbs']:.0f} GB/s, W1 x {result['requests']} requests", "",
             "| model | engine out tok/s | transformers out tok/s | ratio | decode rows | "
             "median step ms | floor ms | floor / step |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in result["models"].items():
        eng, hf = entry["engine"], entry.get("transformers")
        head = (f"| {name} | {eng['output_tok_s']:.1f} | "
                f"{hf['output_tok_s']:.1f} | {entry['ratio']:.2f} |" if hf
                else f"| {name} | {eng['output_tok_s']:.1f} | - | - |")
        for i, b in enumerate(eng["decode_steps"] or [None]):
            prefix = head if i == 0 else "| | | | |"
            lines.append(prefix + (f" {b['rows']} | {b['median_ms']:.2f} | {b['floor_ms']:.2f} | "
                                   f"{b['floor_ratio']:.2f} |" if b else " - | - | - | - |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
