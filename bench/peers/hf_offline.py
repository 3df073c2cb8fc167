"""transformers baselines over the same workloads as bench/bench_offline.py.

Two ways people run a model with plain transformers, so our engine's gain is measured against
both the naive and the best built-in option:

- `static`: `model.generate` on left-padded batches of 16 in workload order. Each batch runs to
  its longest request's max_tokens; the rate counts only the tokens each request asked for
  (the same numerator as ours and vLLM's), the work spent on finished rows is reported apart.
- `cb`: transformers' continuous batching manager (paged KV cache, per-request max_new_tokens).

EOS is truly ignored: for `generate`, a GenerationConfig with eos_token_id=None is merged with the
model's own, so the model's generation_config is cleared too; for `cb`, eos_token_id=-1.
Runs in the project venv:

    python bench/peers/hf_offline.py --mode static --workload random --json-out /tmp/hf.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import WORKLOAD_NAMES, load_workload, warmup_prompts  # noqa: E402


def run_static(model, reqs: list[dict], batch: int, pad_id: int) -> dict:
    """Left-padded `generate` batches; returns timings and the tokens actually generated."""
    import torch
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None

    def one_batch(rows: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)  # a GPU model: inputs follow
        gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=None,
                              eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        if out.shape[1] != width + max_new:  # stopped early: EOS was not ignored
            raise SystemExit(f"generate stopped at {out.shape[1] - width} of {max_new} tokens")

    t0 = time.perf_counter()
    one_batch(warmup_prompts(2), 8)
    t_warm = time.perf_counter() - t0
    generated = 0
    t0 = time.perf_counter()
    for s in range(0, len(reqs), batch):
        rows = reqs[s:s + batch]
        max_new = max(r["max_tokens"] for r in rows)
        one_batch([r["prompt_token_ids"] for r in rows], max_new)
        generated += len(rows) * max_new
    return {"seconds": time.perf_counter() - t0, "warmup_seconds": t_warm,
            "generated_tokens": generated, "batch": batch}


def run_cb(model, reqs: list[dict], pad_id: int, num_blocks: int | None,
           max_batch_tokens: int | None) -> dict:
    """transformers' continuous batching; returns timings and the tokens it generated."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(r["max_tokens"] for r in reqs)
    gc = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1,
                          pad_token_id=pad_id)
    cfg = {}
    if num_blocks:  # without it the cache is sized at ~12 GB on this CPU
        cfg["num_blocks"] = num_blocks
    if max_batch_tokens:
        cfg["max_batch_tokens"] = max_batch_tokens
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in reqs),
                          max_generated_length=longest, num_requests=len(reqs))
    mgr = model.init_continuous_batching(
        generation_config=gc, continuous_batching_config=ContinuousBatchingConfig(**cfg),
        workload_hints=hints)
    t0 = time.perf_counter()
    try:
        mgr.warmup()
    except Exception as exc:  # about CUDA graphs; not needed on CPU
        print(f"cb warm-up skipped: {exc!r}", flush=True)
    mgr.start()

    def run(batch: list[tuple[list[int], int]], tag: str) -> int:
        ids = [mgr.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(batch)]
        done: dict[str, object] = {}
        while len(done) < len(ids):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                done[res.request_id] = res
            elif res is None and not mgr.is_running():
                raise RuntimeError("the continuous batching manager stopped")
        return sum(len(r.generated_tokens) for r in done.values())

    try:
        run([(p, 8) for p in warmup_prompts(2)], "warm")
        t_warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = run([(r["prompt_token_ids"], r["max_tokens"]) for r in reqs], "r")
        dt = time.perf_counter() - t0
    finally:
        mgr.stop(block=True, timeout=10)
    return {"seconds": dt, "warmup_seconds": t_warm, "generated_tokens": got,
            "cb_num_blocks": num_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["static", "cb"], default="static")
    ap.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    ap.add_argument("--model", default=None, help="HF folder (default: our default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16, help="static batch size")
    ap.add_argument("--cb-num-blocks", type=int, default=256)
    ap.add_argument("--cb-max-batch-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from kserve_paged_engine.frontend.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").eval()
    t_load = time.perf_counter() - t0
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if args.mode == "static":
        r = run_static(model, reqs, args.batch, pad_id)
    else:
        r = run_cb(model, reqs, pad_id, args.cb_num_blocks, args.cb_max_batch_tokens)
    n_out = sum(x["max_tokens"] for x in reqs)
    n_in = sum(len(x["prompt_token_ids"]) for x in reqs)
    if args.mode == "cb" and r["generated_tokens"] != n_out:
        raise SystemExit(f"cb generated {r['generated_tokens']} tokens, expected {n_out}")
    dt = r.pop("seconds")
    run = {"rep": 0, "seconds": dt, "output_tokens": n_out, "prompt_tokens": n_in,
           "output_tok_s": n_out / dt, "total_tok_s": (n_out + n_in) / dt,
           "generated_tok_s": r["generated_tokens"] / dt}
    print(f"[hf-{args.mode} {args.workload}] {dt:.1f} s, {run['output_tok_s']:.1f} output tok/s, "
          f"{run['total_tok_s']:.1f} total tok/s", flush=True)
    result = {"engine": f"hf-{args.mode}", "version": transformers.__version__,
              "torch": torch.__version__, "workload": args.workload, "num_prompts": len(reqs),
              "dtype": args.dtype, "init_seconds": t_load, "threads": torch.get_num_threads(),
              **r, "runs": [run]}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
