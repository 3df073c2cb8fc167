"""Perplexity of the default model with a quantized KV cache against float32 KV (issue 34,
item 3: int8 within 1%, fp8 within 2%).

    python bench/kv_quant_ppl.py [--formats int8,fp8_e4m3,fp8_e5m2] [--chunk 50] [--json]

One fixed English text (below: the opening of Dickens' "A Tale of Two Cities", public domain),
scored by the engine itself: each token's log-probability given the ones before it
(`prompt_logprobs`), the prompt prefilled in chunks of `--chunk` tokens (not a multiple of the
block size, so blocks fill over several steps and their scales grow; every query reads the
quantized K/V of earlier chunks and of its own). float32 weights and activations, prefix
caching off; only --kv-cache-dtype differs between the runs. The last stdout line is JSON:
per format, the perplexity, its ratio to float32 KV's, and the mean |log-prob change|.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it was "
    "the winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way - in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only. "
    "There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne "
    "of France. In both countries it was clearer than crystal to the lords of the State "
    "preserves of loaves and fishes, that things in general were settled for ever. "
    "It was the year of Our Lord one thousand seven hundred and seventy-five. Spiritual "
    "revelations were conceded to England at that favoured period, as at this. Mrs. "
    "Southcott had recently attained her five-and-twentieth blessed birthday, of whom a "
    "prophetic private in the Life Guards had heralded the sublime appearance by announcing "
    "that arrangements were made for the swallowing up of London and Westminster. Even the "
    "Cock-lane ghost had been laid only a round dozen of years, after rapping out its "
    "messages, as the spirits of this very year last past (supernaturally deficient in "
    "originality) rapped out theirs. Mere messages in the earthly order of events had lately "
    "come to the English Crown and People, from a congress of British subjects in America: "
    "which, strange to relate, have proved more important to the human race than any "
    "communications yet received through any of the chickens of the Cock-lane brood."
)
TARGETS = {"int8": 1.01, "fp8": 1.02, "fp8_e4m3": 1.02, "fp8_e5m2": 1.02}


def score(kv_cache_dtype: str, chunk: int, model: str | None = None) -> list[float]:
    """Log-probability of every token of TEXT after the first, under this KV format."""
    from kserve_paged_engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=False, max_num_batched_tokens=chunk, max_model_len=1024)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = llm.generate([TEXT], params, use_tqdm=False)[0]
        ids = out.prompt_token_ids
        return [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs)
                if entry is not None]
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()


def compare(formats: list[str], chunk: int, model: str | None = None) -> dict:
    """Perplexity per format and against float32 KV (`auto` with float32 activations)."""
    base = score("auto", chunk, model)
    result = {"tokens": len(base) + 1, "chunk": chunk,
              "auto": {"ppl": math.exp(-sum(base) / len(base))}}
    for fmt in formats:
        lp = score(fmt, chunk, model)
        ppl = math.exp(-sum(lp) / len(lp))
        result[fmt] = {"ppl": ppl, "ratio": ppl / result["auto"]["ppl"],
                       "mean_abs_logprob_change": sum(abs(a - b) for a, b in zip(lp, base))
                       / len(lp), "target": TARGETS[fmt]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args()
    start = time.perf_counter()
    result = compare(args.formats.split(","), args.chunk, args.model)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if not args.json:
        for fmt, r in result.items():
            if isinstance(r, dict):
                ratio = f", x{r['ratio']:.4f} of float32 KV (target <= {r['target']})" \
                    if "ratio" in r else ""
                print(f"{fmt:9s} perplexity {r['ppl']:.4f}{ratio}")
    print(json.dumps(result))
    ok = all(r["ratio"] <= r["target"] for r in result.values()
             if isinstance(r, dict) and "ratio" in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
