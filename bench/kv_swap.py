"""Preemption by swap against recompute (issue 36, item 2): a batch of long generations on a KV
pool that holds about half of it. Three engines: the disk tier on, swapping when its cost model
(measured rates) says so; the tier on, always recomputing (its victims' full blocks still come
back through the tier's prefix lookup); no tier (they come back only while the pool keeps them).

    python bench/kv_swap.py [--model PATH] [--requests 6] [--prompt 512] [--gen 96]
        [--pool-share 0.5] [--rounds 3] [--dtype auto] [--threads N] [--json-out FILE]

Each round submits `--requests` prompts of `--prompt` random tokens at once (new prompts each
round, the same for every engine, so no prefix carries over) and runs them to the end; the
engines take turns within each round, so machine load hits them alike. Figures: wall time of the
rounds, generated tokens per second, tokens computed (what recompute computes again shows
there), preemptions, swaps out and in, and the rates the cost model read.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any


def build(args: argparse.Namespace, root: Path | None) -> Any:
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    need = args.requests * (args.prompt + args.gen)
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}}
    return LLMEngine(model=args.model, dtype=args.dtype, block_size=16,
                     num_kv_blocks=int(need * args.pool_share) // 16 + 1,
                     max_num_seqs=args.requests, max_model_len=args.prompt + args.gen + 16,
                     max_num_batched_tokens=1024,
                     kv_transfer_config=tier if root is not None else None)


def always_recompute(engine: Any) -> None:
    """The recompute engine: every preemption's choice is recompute (logged as forced)."""
    from kserve_paged_engine.core.kv_tier.swap import SwapChoice

    engine.kv.tier.swaps.choose = lambda tokens, out, back: SwapChoice(
        False, "recompute: forced by the benchmark", tokens, out, back, 0.0, 0.0)


def one_round(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, int]:
    """(wall seconds, tokens computed: prompts, outputs and what preemptions computed again)."""
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(engine.next_request_id(), p, params)
    computed = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_step_tokens
    return time.perf_counter() - t0, computed


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kserve_paged_engine.sampling_params import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="kv-swap-bench-"))
    engines = {"no_tier": build(args, None), "recompute": build(args, root / "recompute"),
               "swap": build(args, root / "swap")}
    always_recompute(engines["recompute"])
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    wall = {m: 0.0 for m in engines}
    computed = {m: 0 for m in engines}
    warm = [[rng.randrange(100, 49000) for _ in range(64)]]
    for eng in engines.values():  # first-call costs out of the figures
        one_round(eng, warm, SamplingParams(max_tokens=4, temperature=0.0))
    for _ in range(args.rounds):
        prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt)]
                   for _ in range(args.requests)]
        for mode, eng in engines.items():
            took, tokens = one_round(eng, prompts, params)
            wall[mode] += took
            computed[mode] += tokens
    generated = args.rounds * args.requests * args.gen
    out: dict[str, Any] = {
        "date": date.today().isoformat(), "model": engines["swap"].model_path,
        "dtype": str(engines["swap"].dtype), "threads": args.threads,
        "workload": {k: getattr(args, k) for k in ("requests", "prompt", "gen", "pool_share",
                                                   "rounds")},
        "pool_blocks": engines["swap"].num_kv_blocks}
    for mode, eng in engines.items():
        s = eng.stats()
        out[mode] = {"wall_s": round(wall[mode], 2),
                     "generated_tokens_per_s": round(generated / wall[mode], 1),
                     "preemptions": s["num_preemptions"], "swap_outs": s.get("kv_swap_outs"),
                     "swap_ins": s.get("kv_swap_ins"), "swap_short": s.get("kv_swap_short"),
                     "prefix_hit_tokens": s["prefix_cache_hits"],
                     "tier_block_hits": s.get("kv_tier_block_hits"),
                     "tokens_computed": computed[mode]}
        eng.close()
    swaps = engines["swap"].kv.tier.swaps
    out["swap_rates"] = {"prefill_tokens_s": round(swaps.prefill.value, 1),
                         "write_mb_s": round(swaps.tier.writer.write_rate.value / 1e6, 1),
                         "read_mb_s": round(swaps.tier.read_rate.value / 1e6, 1)}
    out["ratio_wall_swap_over_recompute"] = round(wall["swap"] / wall["recompute"], 3)
    out["ratio_wall_swap_over_no_tier"] = round(wall["swap"] / wall["no_tier"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--pool-share", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    text = json.dumps(run(args), indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
