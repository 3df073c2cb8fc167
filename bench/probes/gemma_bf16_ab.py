"""Gemma in bfloat16 with its native elementwise ops on and off, in one process.

A probe for BENCHMARKS.md (not part of the engine): builds the engine as bench_offline.py does
(tcmalloc, max_model_len 2048, prefix cache off), then generates W1's first N requests
(greedy, ignore_eos) again and again, alternating between Gemma's native bf16 ops
(`cpu_native.gemma_add_rms_norm`, `gemma_qk_norm_inplace` with the native RoPE after it,
`gelu_mul`: csrc/gemma_bf16.c) and the torch ops they replace (the three wrappers made to
decline, so every caller takes its torch path, as before they existed). Per run: the wall time
and the forward time of the prefill-sized steps (more than 64 rows) and of the decode steps.
Greedy tokens are compared between the two paths.

    OMP_NUM_THREADS=2 python bench/probes/gemma_bf16_ab.py \
        --model ~/.cache/kserve-paged/models/gemma-3-270m [--num-prompts 16] [--max-tokens 64] \
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NATIVE = ("gemma_add_rms_norm", "gemma_qk_norm_inplace", "gelu_mul")


def _declined(*_args: object, **_kwargs: object) -> None:
    return None


def _toggle(on: bool, real: dict) -> None:
    from kserve_paged_kernels import cpu_native

    for name in NATIVE:
        setattr(cpu_native, name, real[name] if on else _declined)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    from benchlib import load_workload, timed_steps, warmup_prompts

    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_kernels import cpu_native

    steps = timed_steps()
    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=False, max_model_len=2048)
    model = llm.engine.model
    print(f"model {model.architecture}, bfloat16, stack: "
          f"{'built' if model.native_stack is not None else model.native_stack_declined}")
    real = {name: getattr(cpu_native, name) for name in NATIVE}
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(args.rounds):
        for on in (True, False):
            _toggle(on, real)
            steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens[on] = [list(o.outputs[0].token_ids) for o in outs]
            runs[on].append((wall, sum(s for n, s in steps if n > 64),
                             sum(s for n, s in steps if n <= 64)))
            print(f"native {'on ' if on else 'off'}: wall {wall:.3f} s, prefill steps "
                  f"{runs[on][-1][1]:.3f} s, decode steps {runs[on][-1][2]:.3f} s", flush=True)
    _toggle(True, real)
    _report(runs, sum(len(t) for t in tokens[True]))
    print("greedy tokens equal:", tokens[True] == tokens[False])


def _report(runs: dict[bool, list[tuple[float, float, float]]], out_tokens: int) -> None:
    for on in (True, False):
        best = [min(r[i] for r in runs[on]) for i in range(3)]
        med = [statistics.median(r[i] for r in runs[on]) for i in range(3)]
        print(f"native {'on ' if on else 'off'} best wall/prefill/decode {best[0]:.3f} / "
              f"{best[1]:.3f} / {best[2]:.3f} s ({out_tokens / best[0]:.1f} tok/s); median "
              f"{med[0]:.3f} / {med[1]:.3f} / {med[2]:.3f} s ({out_tokens / med[0]:.1f} tok/s)")
    pairs = [off[0] / on[0] for on, off in zip(runs[True], runs[False], strict=True)]
    print(f"wall off/on per round: {', '.join(f'{p:.3f}' for p in pairs)}; median "
          f"{statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
