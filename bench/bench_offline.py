"""Offline throughput of the engine over the benchmark workloads (W1 random, W2 shared prefix).

Greedy, ignore_eos, each request's own max_tokens, all requests submitted at once; a short
warm-up on unrelated tokens first. Prints output tokens/s and total tokens/s, and the KV slot
accounting (share of allocated slots that hold tokens, sampled every step).

    python bench/bench_offline.py --workload random [--repeats 2] [--json-out FILE]
    python bench/bench_offline.py --workload shared
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import WORKLOAD_NAMES, load_workload, warmup_prompts  # noqa: E402


class SlotCounter:
    """Sums, after every engine step, the KV slots holding tokens and the slots allocated, and
    what two contiguous schemes would have reserved for the same running requests: max_model_len
    slots each (a max-length reservation, as before paging), or prompt + max_tokens each (the
    best a contiguous scheme can do when it knows every request's limit)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reset()
        self._step = engine.step
        engine.step = self.step

    def reset(self) -> None:
        self.used = self.alloc = self.max_len_reserved = self.exact_reserved = 0

    def step(self):
        outs = self._step()
        sched = self.engine.scheduler
        s = sched.stats()
        self.used += s["kv_slots_used"]
        self.alloc += s["kv_slots_allocated"]
        self.max_len_reserved += len(sched.running) * self.engine.max_model_len
        self.exact_reserved += sum(r.num_prompt_tokens + r.sampling_params.max_tokens
                                   for r in sched.running)
        return outs


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    ap.add_argument("--model", default=None, help="local HF folder (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default=None,
                    help="default: off for random, on for shared")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="first N requests only (smoke runs)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every output at N")
    ap.add_argument("--quantization", default=None, help="the engine's --quantization (e.g. gguf)")
    ap.add_argument("--json-out", default=None)
    return ap.parse_args()


def main() -> None:
    args = _parse_args()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the server does (KSERVE_PAGED_TCMALLOC=0: glibc malloc)
    import torch

    from kserve_paged_engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    caching = args.prefix_caching or ("on" if args.workload == "shared" else "off")
    reqs = load_workload(args.workload, args.num_prompts, args.max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=caching == "on",
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_model_len=2048,
              quantization=args.quantization)
    t_init = time.perf_counter() - t0
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    engine = llm.engine
    slots = SlotCounter(engine)
    runs = []
    for rep in range(args.repeats):
        llm.reset_prefix_cache()
        hits0 = engine.kv.prefix_cache_hits
        slots.reset()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        used, alloc = slots.used, slots.alloc
        contiguous = {"max_model_len_reservation": used / slots.max_len_reserved,
                      "prompt_plus_max_tokens_reservation": used / slots.exact_reserved}
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(p) for p in prompts)
        run = {"rep": rep, "seconds": dt, "output_tokens": n_out, "prompt_tokens": n_in,
               "output_tok_s": n_out / dt, "total_tok_s": (n_out + n_in) / dt,
               "prefix_cache_hit_tokens": engine.kv.prefix_cache_hits - hits0,
               "kv_slots_used_share": used / alloc if alloc else None,
               "contiguous_used_share": contiguous,
               "preemptions": engine.scheduler.num_preemptions}
        runs.append(run)
        print(f"[{args.workload}] rep {rep}: {dt:.1f} s, {run['output_tok_s']:.1f} output tok/s, "
              f"{run['total_tok_s']:.1f} total tok/s, cache hits {run['prefix_cache_hit_tokens']}"
              f" tokens, KV slots holding tokens {100 * (run['kv_slots_used_share'] or 0):.1f}% "
              f"(contiguous max_model_len reservation: "
              f"{100 * contiguous['max_model_len_reservation']:.1f}%, prompt + max_tokens "
              f"reservation: {100 * contiguous['prompt_plus_max_tokens_reservation']:.1f}%)")
    result = {"engine": "kserve-paged", "workload": args.workload, "num_prompts": len(reqs),
              "prefix_caching": caching, "dtype": args.dtype,
              "quantization": args.quantization, "init_seconds": t_init, "threads": torch.get_num_threads(), "runs": runs}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
