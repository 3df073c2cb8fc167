"""A mixture-of-experts model under tensor parallelism on CPU: TP = 1 x 2 threads, TP = 2 x 1
thread with each expert cut (all-reduces only), and TP = 2 x 1 thread with expert parallelism
(`--enable-expert-parallel`: whole experts spread, tokens exchanged by all-to-all), then
TP = 1 x 1 thread, in one process and one run, with the all-reduce and all-to-all time per
step (a collective's time includes waiting for the slower rank).

No hub here: without --model a random Qwen3-MoE-shaped checkpoint (8 experts, top-2, the
default model's tokenizer) is written once into --cache-dir and served as float32. On 2
cores no speed-up is expected; the figures are the exchanges' cost.

    python bench/bench_ep.py --num-prompts 16 --max-tokens 64 --json-out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_tp import run  # noqa: E402
from benchlib import WORKLOAD_NAMES, load_workload  # noqa: E402

# The random model's shape: small enough for 2 cores, every layer sparse.
MOE_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], vocab_size=49152,
                 max_position_embeddings=4096, tie_word_embeddings=True)


def random_moe(folder: Path) -> Path:
    """The random checkpoint (written once; the tests' recipe, tests/helpers/tiny_models.py)."""
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import Qwen3MoeConfig

    from tests.helpers.tiny_models import copy_default_tokenizer, save_random

    folder.mkdir(parents=True, exist_ok=True)
    save_random(Qwen3MoeConfig(**MOE_SHAPE), folder, seed=0)
    copy_default_tokenizer(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    ap.add_argument("--model", default=None, help="a local MoE folder (default: a random one)")
    ap.add_argument("--cache-dir", default="/tmp/kserve-paged-bench-moe")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the server does
    args.model = args.model or str(random_moe(Path(args.cache_dir)))
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    load = os.getloadavg()
    runs = [run(1, 2, reqs, args), run(2, 2, reqs, args),
            run(2, 2, reqs, args, expert_parallel=True)]
    # TP = 1 on one thread too: the per-rank threads of TP = 2, apart from how two OpenMP
    # threads fare on a loaded machine.
    runs.append(run(1, 1, reqs, args))
    tokens = [r.pop("tokens") for r in runs]
    same = all(t == tokens[0] for t in tokens)
    one = runs[0]["output_tok_s"]
    print(f"output tok/s over TP=1x2: cut {runs[1]['output_tok_s'] / one:.2f}, expert parallel "
          f"{runs[2]['output_tok_s'] / one:.2f}, TP=1x1 {runs[3]['output_tok_s'] / one:.2f}; "
          f"same greedy tokens: {same}; load average at "
          f"start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({
            "model": args.model, "shape": MOE_SHAPE if "bench-moe" in args.model else None,
            "workload": args.workload, "num_prompts": len(reqs), "max_tokens": args.max_tokens,
            "dtype": args.dtype, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_start": load, "load_average_end": os.getloadavg(),
            "same_greedy_tokens": same, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
