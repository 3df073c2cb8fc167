"""Block accounting of sharing: peak KV blocks of one beam search and one n > 1 request, with
blocks shared by forks and copy-on-write (what the engine holds) against every sequence holding
its own table (what it would hold without sharing), sampled after every engine step.

    python bench/bench_block_sharing.py [--model PATH] [--prompt-tokens 400]
        [--new-tokens 128] [--beam-width 4] [--n 8] [--json-out FILE]

Float32, block size 16, prefix caching off (so all sharing is forking), ignore_eos. The prompt
is random token ids (seed 0).
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import date
from typing import Any


def measure(engine: Any, prompt: list[int], params: Any, request_id: str) -> dict[str, Any]:
    """Run one request to its end; peak blocks held (shared) and peak sum of table lengths
    (unshared), both taken after each step, plus copy-on-write copies made."""
    kv = engine.kv
    copies = kv.num_cow_copies
    engine.add_request(request_id, prompt, params)
    shared = unshared = seqs = 0
    while engine.has_unfinished_requests():
        engine.step()
        shared = max(shared, kv.pool.num_used_blocks)
        unshared = max(unshared, sum(len(t) for t in kv.req_block_ids.values()))
        seqs = max(seqs, len(kv.req_block_ids))
    assert kv.pool.num_used_blocks == 0, "blocks leaked"
    return {"peak_blocks_shared": shared, "peak_blocks_unshared": unshared,
            "saving": round(1 - shared / unshared, 4) if unshared else 0.0,
            "cow_copies": kv.num_cow_copies - copies, "max_sequences": seqs}


def run(model: str | None, prompt_tokens: int, new_tokens: int, beam_width: int,
        n: int) -> dict[str, Any]:
    from kserve_paged_engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", block_size=16, enable_prefix_caching=False,
              max_model_len=prompt_tokens + new_tokens + 16,
              num_kv_blocks=(n + beam_width) * (-(-(prompt_tokens + new_tokens) // 16) + 2))
    engine = llm.engine
    rng = random.Random(0)
    prompt = [rng.randrange(100, engine.model.vocab_size) for _ in range(prompt_tokens)]
    beam = SamplingParams(n=beam_width, use_beam_search=True, max_tokens=new_tokens,
                          ignore_eos=True)
    samples = SamplingParams(n=n, max_tokens=new_tokens, temperature=1.0, seed=0,
                             ignore_eos=True)
    return {
        "date": date.today().isoformat(), "model": engine.model_path, "dtype": "float32",
        "block_size": 16, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        f"beam_width_{beam_width}": measure(engine, prompt, beam, "beam"),
        f"n_{n}": measure(engine, prompt, samples, "samples"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    result = run(a.model, a.prompt_tokens, a.new_tokens, a.beam_width, a.n)
    text = json.dumps(result, indent=2)
    print(text)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
