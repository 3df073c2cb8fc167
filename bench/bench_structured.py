"""What structured outputs cost: W1-like requests all under a JSON schema vs none, same run.

Greedy; the free run uses ignore_eos, the constrained run a schema the output cannot close
within the budget (a list of at least 24 records), so both compute the same tokens and batch
the same way (the count of requests that ended early is printed to show it). Reports
output tok/s of each, the constrained/free ratio, the share of the constrained run's time
spent filling and applying token bitmasks and advancing matchers (the constrained step's extra
cost), and the cold compile time of a few schemas.

    python bench/bench_structured.py [--num-prompts 64] [--max-tokens 128] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import load_workload, warmup_prompts  # noqa: E402

RECORDS = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 24,
    "items": {"type": "object", "required": ["name", "qty", "note"],
                               "properties": {"name": {"type": "string"},
                                              "qty": {"type": "integer"},
                                              "note": {"type": "string"}}}}}}
COMPILE_SCHEMAS = {
    "records": RECORDS,
    "person": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
    "order": {"type": "object", "required": ["id", "items", "status"], "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["sku", "qty"], "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1}}}}}},
}


class Timed:
    """Wraps a method and sums the seconds spent in it."""

    def __init__(self, owner: object, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json-out", default=None)
    return ap.parse_args()


def main() -> None:
    args = _parse_args()

    from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.sampling_params import StructuredOutputs

    reqs = load_workload("random", args.num_prompts, args.max_tokens)
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False, max_model_len=2048)
    engine = llm.engine
    llm.generate(warmup_prompts(), SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()  # the tokenizer's table, built once per engine
    engine.grammars.submit(StructuredOutputs(regex="a")).result()
    compile_s = {"tokenizer_table_and_regex": time.perf_counter() - t0}
    for name, schema in COMPILE_SCHEMAS.items():  # cold: each compiles once, off the step
        t0 = time.perf_counter()
        engine.grammars.submit(StructuredOutputs(json=schema)).result()
        compile_s[name] = time.perf_counter() - t0
    prompts = [r["prompt_token_ids"] for r in reqs]
    free = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
            for r in reqs]
    constrained = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                  structured_outputs={"json": RECORDS}) for r in reqs]
    mask = Timed(engine.sampling.bitmask, "apply")
    accept = Timed(engine.sampling, "accept")
    runs = {}
    for label, params in (("free", free), ("constrained", constrained), ("free_again", free)):
        mask.seconds = accept.seconds = 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        runs[label] = {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
                       "ended_early": sum(o.outputs[0].finish_reason != "length" for o in outs),
                       "grammar_seconds": mask.seconds + accept.seconds}
        print(f"{label}: {dt:.1f} s, {n_out} tokens, {n_out / dt:.1f} output tok/s, "
              f"grammar work {mask.seconds + accept.seconds:.2f} s, "
              f"{runs[label]['ended_early']} ended before max_tokens")
    free_tok_s = (runs["free"]["output_tok_s"] + runs["free_again"]["output_tok_s"]) / 2
    c = runs["constrained"]
    result = {
        "workload": f"W1 random, first {len(reqs)} requests, max_tokens <= {args.max_tokens}",
        "dtype": args.dtype, "threads": torch.get_num_threads(), "runs": runs,
        "constrained_over_free_tok_s": c["output_tok_s"] / free_tok_s,
        "grammar_share_of_constrained_time": c["grammar_seconds"] / c["seconds"],
        "compile_seconds": compile_s,
    }
    print(f"constrained / free output tok/s: {result['constrained_over_free_tok_s']:.3f}; "
          f"bitmask + matcher share of the constrained run: "
          f"{100 * result['grammar_share_of_constrained_time']:.1f}%; compile seconds: "
          + ", ".join(f"{k} {v:.3f}" for k, v in compile_s.items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
