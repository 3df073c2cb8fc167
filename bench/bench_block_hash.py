"""Prefix-cache block hashing: microseconds per full block, each --prefix_caching_hash_algo.

Workload: the chains of 256 prompts of 1,000-4,000 random token ids (seeded, as
bench/bench_scheduler.py), block size 16, hashed block by block as the KV manager does when a
prompt arrives. The peer in the same run is the key this engine used before vLLM's: SHA-256 over
the parent key and the tokens as int64 bytes (numpy), no serialisation.

    python bench/bench_block_hash.py [--requests 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import numpy as np

from kserve_paged_engine.config.engine import HASH_ALGOS
from kserve_paged_engine.core.block_hash import BlockHasher


def int64_sha256(parent: bytes | None, tokens: list[int], extra=None) -> bytes:
    h = hashlib.sha256(parent if parent is not None else b"\x00" * 32)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def time_chains(fn, prompts: list[list[int]], bs: int) -> float:
    t0 = time.perf_counter()
    for tokens in prompts:
        parent = None
        for i in range(len(tokens) // bs):
            parent = fn(parent, tokens[i * bs:(i + 1) * bs], None)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bs = 16
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1000, 4001))]
               for _ in range(args.requests)]
    blocks = sum(len(p) // bs for p in prompts)
    fns = {"int64 bytes (before)": int64_sha256}
    fns.update({algo: BlockHasher(algo, seed="0") for algo in HASH_ALGOS})
    print(f"prompts={args.requests} blocks={blocks} block_size={bs} (best of {args.repeats})")
    best = {name: float("inf") for name in fns}
    for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits all alike
        for name, fn in fns.items():
            best[name] = min(best[name], time_chains(fn, prompts, bs))
    base = best["int64 bytes (before)"]
    for name, t in best.items():
        print(f"{name:22s} {t / blocks * 1e6:6.2f} us/block  {t / base:4.2f}x the int64 key")


if __name__ == "__main__":
    main()
