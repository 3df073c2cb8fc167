"""Issue 36's benchmark: a multi-turn chat trace on a KV pool that holds a fraction of the
working set, the second (disk) tier on and off in the same run.

    python bench/kv_tier.py [--model PATH] [--conversations 8] [--turns 4]
        [--history 1024] [--turn-tokens 256] [--pool-tokens 4096] [--dtype auto]
        [--root DIR] [--threads N] [--json-out FILE]

Each conversation starts from a shared system prompt (256 tokens) and its own history
(`--history` tokens); each turn appends the last reply and a new user message (`--turn-tokens`
each, fixed token ids: replies are part of the trace, so both engines see the same prompts) and
asks for 16 greedy tokens. Turns go round-robin over the conversations, one request at a time,
so by the time a conversation returns the pool has turned over. Every turn runs on both engines
back to back (off, then on), so machine load hits both alike. TTFT is add-to-first-token of a
lone request (= its prefill); "returning turns" are turns 2..N. The disk's bandwidth is
measured in the tier's folder (write + fsync, then read back) and set beside the tier's rates.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

SYSTEM_TOKENS = 256
NEW_TOKENS = 16


def trace(conversations: int, turns: int, history: int, turn_tokens: int,
          vocab: int = 49000, seed: int = 0) -> list[list[list[int]]]:
    """prompts[turn][conversation]: each turn's prompt is the previous one plus a reply and a
    user message."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    system = toks(SYSTEM_TOKENS)
    prompts = [[system + toks(history) for _ in range(conversations)]]
    for _ in range(1, turns):
        prompts.append([p + toks(turn_tokens) + toks(turn_tokens) for p in prompts[-1]])
    return prompts


def one_request(engine: Any, prompt: list[int], params: Any) -> tuple[float, float]:
    """(TTFT, end-to-end) of a lone request, seconds."""
    rid = engine.next_request_id()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


def disk_bandwidth(folder: Path, mib: int = 256) -> dict[str, float]:
    """Sequential write (with fsync) and read-back of one file in `folder`, MiB/s. The read
    may come from the page cache, as the tier's reads of fresh blocks do."""
    path = folder / "bw.probe"
    chunk = os.urandom(4 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib // 4):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = mib / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(4 << 20):
            pass
    read = mib / (time.perf_counter() - t0)
    path.unlink()
    return {"write_mib_s": round(write, 1), "read_mib_s": round(read, 1)}


def summary(ttft: list[float], e2e: list[float], tokens: int) -> dict[str, float]:
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else ttft * 99
    return {"ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p99_s": round(q[98], 4),
            "tokens_per_s": round(tokens / sum(e2e), 1), "requests": len(ttft)}


def build(args: argparse.Namespace, root: Path | None) -> Any:
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    kw: dict[str, Any] = dict(model=args.model, dtype=args.dtype, block_size=16,
                              num_kv_blocks=args.pool_tokens // 16, max_num_seqs=4,
                              max_model_len=args.pool_tokens, max_num_batched_tokens=2048)
    if root is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                "eviction_policy": "lru",
                "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}}
    return LLMEngine(**kw)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kserve_paged_engine.sampling_params import SamplingParams

    root = Path(args.root or tempfile.mkdtemp(prefix="kv-tier-bench-"))
    engines = {"off": build(args, None), "on": build(args, root)}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for eng in engines.values():  # first-call costs out of the figures
        one_request(eng, list(range(200, 264)), params)
    prompts = trace(args.conversations, args.turns, args.history, args.turn_tokens)
    times: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "e2e": [], "rttft": [],
                                                    "re2e": []} for m in engines}
    tokens = {"all": 0, "returning": 0}
    for t, turn in enumerate(prompts):
        for prompt in turn:
            for mode, eng in engines.items():
                ttft, e2e = one_request(eng, prompt, params)
                times[mode]["ttft"].append(ttft)
                times[mode]["e2e"].append(e2e)
                if t:
                    times[mode]["rttft"].append(ttft)
                    times[mode]["re2e"].append(e2e)
            tokens["all"] += len(prompt) + NEW_TOKENS
            tokens["returning"] += (len(prompt) + NEW_TOKENS) if t else 0
    return report(args, engines, times, tokens, root, prompts)


def report(args, engines, times, tokens, root, prompts) -> dict[str, Any]:
    tier = engines["on"].kv_tier
    tier.writer.flush()
    st = tier.stats
    out: dict[str, Any] = {
        "date": date.today().isoformat(), "dtype": str(engines["on"].dtype),
        "threads": args.threads,
        "model": engines["on"].model_path,
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "system_tokens": SYSTEM_TOKENS, "history": args.history,
                     "turn_tokens": args.turn_tokens, "new_tokens": NEW_TOKENS,
                     "prompt_tokens_last_turn": len(prompts[-1][0]),
                     "working_set_tokens": sum(len(p) for p in prompts[-1]),
                     "pool_tokens": args.pool_tokens},
        "all_turns": {m: summary(v["ttft"], v["e2e"], tokens["all"]) for m, v in times.items()},
        "returning_turns": {m: summary(v["rttft"], v["re2e"], tokens["returning"])
                            for m, v in times.items()},
        "tier": {"block_queries": st.queries, "block_hits": st.hits,
                 "read_mib": round(st.bytes_read / 2**20, 1),
                 "read_mib_s": round(st.bytes_read / 2**20 / st.read_s, 1) if st.read_s else None,
                 "written_mib": round(tier.writer.bytes_written / 2**20, 1),
                 "disk_write_mib_s": round(tier.writer.bytes_written / 2**20
                                           / tier.writer.write_s, 1)
                 if tier.writer.write_s else None,
                 "corrupt": st.corrupt},
        "disk": disk_bandwidth(root),
    }
    on, off = out["returning_turns"]["on"], out["returning_turns"]["off"]
    out["ratio_returning_ttft_p50_on_over_off"] = round(on["ttft_p50_s"] / off["ttft_p50_s"], 3)
    out["ratio_throughput_on_over_off"] = round(
        out["all_turns"]["on"]["tokens_per_s"] / out["all_turns"]["off"]["tokens_per_s"], 3)
    for eng in engines.values():
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--root", default=None, help="the tier's folder (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch (and native kernel) threads; on a shared, loaded machine 1 "
                         "keeps threads from waiting on each other at every barrier")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
