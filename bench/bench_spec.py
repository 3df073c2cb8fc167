"""Speculative decoding, same run: n-gram prompt lookup (or a draft model) on vs off over a
repetitive workload (prompts whose answer repeats their text: copy, extraction, editing) and
over W1.

One engine; the off runs drop its SpecDecoder, so both use the same weights, KV pool and
warm caches, alternating off/on per repeat. Greedy, all requests at once, at most
--max-num-seqs running (a finished request's seat goes to the next). The repetitive prompts
are chat turns through the model's template and end at EOS (or max_tokens); W1 keeps its own
definition (token-id prompts, ignore_eos). Reports
output tok/s of each, the ratio on/off, steps, mean accepted length (1 + kept drafts per
verified step, vLLM's definition) and the acceptance rate; checks the outputs are identical.

    python bench/bench_spec.py [--dtype float32] [--repeats 2] [--json-out FILE]
    python bench/bench_spec.py --method draft_model --draft-layers 8   # layer-skip draft
    python bench/bench_spec.py --method draft_model --draft-model self  # upper bound

`--draft-layers N` drafts with the target's first N layers and its head
(bench/layer_skip_draft.py writes that checkpoint once, next to the target); `--draft-model
self` drafts with the target itself: every greedy draft is kept, so it bounds the accepted
length, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import load_workload, warmup_prompts  # noqa: E402

SENTENCES = [
    "The invoice number is 4471 and the total due is 1,280 euros.",
    "Shipping address: 12 Harbour Road, Leith, Edinburgh EH6 6LX.",
    "Our meeting moved from Tuesday at ten to Thursday at three in room B.",
    "Please keep the server logs for ninety days and rotate them weekly.",
    "The patient reported mild headaches after the second dose of the medication.",
    "def area(width, height):\n    return width * height\n",
    "for item in items:\n    total += item.price * item.quantity\n",
    "The committee approved the budget of 2.4 million for the new library wing.",
    "Contact Maria Lopez at maria.lopez@example.com for the signed contract.",
    "The train to Lyon leaves platform 7 at 14:52 and arrives at 18:30.",
    "Water boils at 100 degrees Celsius at sea level and lower at altitude.",
    "The firmware update fixes the Bluetooth pairing bug on model X200.",
]
TEMPLATES = [
    "Repeat the following text exactly, nothing else:\n\n{text}",
    "Here is a note. Rewrite it in full, unchanged:\n\n{text}",
    "Quote this passage verbatim:\n\n{text}",
]


def repetitive_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        text = " ".join(rng.sample(SENTENCES, 4))
        prompts.append(TEMPLATES[i % len(TEMPLATES)].format(text=text))
    return prompts


def _run_workload(llm, decoder, steps: list[int], name: str, prompts: list, max_tokens: list[int],
                  ignore_eos: bool, repeats: int) -> dict:
    """One workload, speculation off and on in alternating order per repeat; each run's rate,
    steps and draft figures, and whether the outputs were identical."""
    from kserve_paged_engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos)
              for m in max_tokens]
    runs = {"off": [], "on": []}
    outputs = {}
    for rep in range(repeats):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            llm.engine.spec = decoder if mode == "on" else None
            before = decoder.stats()
            steps[0] = 0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            after = decoder.stats()
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            drafted = (after["spec_decode_num_draft_tokens"]
                       - before["spec_decode_num_draft_tokens"])
            kept = (after["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"])
            run = {"rep": rep, "seconds": dt, "output_tokens": n_out,
                   "output_tok_s": n_out / dt, "steps": steps[0],
                   "verified_steps_with_drafts": drafts, "draft_tokens": drafted,
                   "accepted_tokens": kept,
                   "mean_accepted_length": 1 + kept / drafts if drafts else None,
                   "acceptance_rate": kept / drafted if drafted else None}
            runs[mode].append(run)
            outputs.setdefault(mode, [o.outputs[0].token_ids for o in outs])
            texts = [o.outputs[0].text for o in outs]
            print(f"[{name}] {mode} rep {rep}: {dt:.1f} s, {run['output_tok_s']:.1f} "
                  f"output tok/s, {steps[0]} steps, mean accepted length "
                  f"{run['mean_accepted_length']}, acceptance {run['acceptance_rate']}",
                  flush=True)
    best = {m: max(r["output_tok_s"] for r in rs) for m, rs in runs.items()}
    result = {"runs": runs, "best_output_tok_s": best,
              "ratio_on_off": best["on"] / best["off"],
              "identical_outputs": outputs["on"] == outputs["off"],
              "num_prompts": len(prompts),
              "output_tokens": sum(map(len, outputs["off"])),
              "first_outputs": texts[:2] if name == "repetitive" else None}
    print(f"[{name}] on/off {result['ratio_on_off']:.2f}x, identical outputs: "
          f"{result['identical_outputs']}", flush=True)
    return result


def _spec_config(args: argparse.Namespace) -> dict:
    """vLLM's --speculative-config for the chosen method (a draft: a folder, the target
    itself, or the target's first layers)."""
    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_max": args.prompt_lookup_max,
                   "prompt_lookup_min": args.prompt_lookup_min}
    if args.method == "draft_model":
        from layer_skip_draft import make_layer_skip_draft

        from kserve_paged_engine.frontend.default_model import ensure_default_model

        target = args.model or str(ensure_default_model())
        if args.draft_layers is not None:
            draft = str(make_layer_skip_draft(target, args.draft_layers))
        elif args.draft_model in (None, "self"):
            draft = target
        else:
            draft = args.draft_model
        spec_config = {"method": "draft_model", "model": draft,
                       "num_speculative_tokens": args.num_speculative_tokens}
    return spec_config


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local HF folder (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None, help="draft folder, or 'self' (the target)")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="draft = the target's first N layers (bench/layer_skip_draft.py)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--num-repetitive", type=int, default=8)
    ap.add_argument("--repetitive-max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--w1-prompts", type=int, default=8, help="first N requests of W1")
    ap.add_argument("--w1-max-tokens", type=int, default=64, help="cap on W1 outputs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    load_at_start = os.getloadavg()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    import torch

    from kserve_paged_engine import LLM, SamplingParams

    spec_config = _spec_config(args)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              speculative_config=spec_config)
    engine = llm.engine
    decoder = engine.spec
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)
    w1 = load_workload("random", args.w1_prompts, args.w1_max_tokens)
    chats = [llm.apply_chat_template([{"role": "user", "content": p}])
             for p in repetitive_prompts(args.num_repetitive)]
    workloads = {  # name: (prompts, max_tokens, ignore_eos)
        "repetitive": (chats, [args.repetitive_max_tokens] * args.num_repetitive, False),
        "w1": ([r["prompt_token_ids"] for r in w1], [r["max_tokens"] for r in w1], True),
    }
    steps = [0]
    inner = engine.step

    def counted():
        steps[0] += 1
        return inner()

    engine.step = counted
    results = {name: _run_workload(llm, decoder, steps, name, *work, args.repeats)
               for name, work in workloads.items()}
    result = {"engine": "kserve-paged", "bench": "spec_decode", "dtype": args.dtype,
              "speculative_config": spec_config, "threads": torch.get_num_threads(),
              "max_num_seqs": args.max_num_seqs,
              "load_at_start": load_at_start, "load_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                     time.gmtime()),
              "workloads": results}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
