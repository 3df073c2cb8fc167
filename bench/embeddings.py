"""Embeddings per second for all-MiniLM-L6-v2 (issue 35): our engine offline and through the
server, next to sentence-transformers' `encode` on the same CPU in the same run.

Workload: 256 sentences of 8-128 tokens (seeded words; lengths uniform), every one sent at once
(offline: one `LLM.embed`; server: one `/openai/v1/embeddings` request per sentence, 32 in
flight). Each side runs once to warm up, then `--repeats` times; the best run counts. The
embeddings are checked against sentence-transformers (cosine >= 0.9999) so a fast wrong answer
cannot count. Prints a JSON record (and writes it with --json-out).

    python bench/embeddings.py [--repeats 3] [--threads 2] [--no-server] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

WORDS = ["paged", "attention", "keeps", "the", "cache", "in", "blocks", "so", "many", "requests", "share", "memory", "while", "the", "scheduler", "batches", "prompts", "of", "every", "length", "and", "the", "model", "computes", "them", "at", "once", "kubernetes", "serves", "models", "behind", "one", "gateway", "with", "autoscaling", "on", "requests"]


def sentences(tok, n: int = 256, seed: int = 0) -> list[str]:
    """n texts whose token counts (special tokens included) are uniform in 8..128."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(8, 128)
        words = [rng.choice(WORDS) for _ in range(target)]
        while len(tok.encode(" ".join(words))) > target and len(words) > 1:
            words.pop()
        out.append(" ".join(words))
    return out


def best_of(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


async def _serve_all(url: str, texts: list[str], concurrency: int) -> np.ndarray:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(text: str) -> list[float]:
            async with sem:
                r = await client.post(f"{url}/openai/v1/embeddings", json={"input": text})
                r.raise_for_status()
                return r.json()["data"][0]["embedding"]
        return np.array(await asyncio.gather(*map(one, texts)), dtype=np.float32)


def through_server(texts: list[str], repeats: int, threads: int) -> tuple[float, np.ndarray]:
    from kserve_paged.testing import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", "minilm", "--model_id",
           "all-minilm-l6-v2", "--http_host", "127.0.0.1", "--http_port", str(port),
           "--enable_grpc", "false", "--max_num_seqs", "256", "--max_num_batched_tokens", "8192"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = ServerProcess(cmd, [f"http://127.0.0.1:{port}/v2/models/minilm/ready"], env=env,
                         timeout_s=300)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        return best_of(lambda: asyncio.run(_serve_all(url, texts, 32)), repeats)
    finally:
        proc.stop(grace_s=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from kserve_paged_engine import LLM
    from kserve_paged_engine.frontend.packaged_folders import ensure_folder_model

    torch.set_num_threads(args.threads)
    folder = str(ensure_folder_model("all-minilm-l6-v2"))
    st = SentenceTransformer(folder, device="cpu")
    texts = sentences(st.tokenizer)
    st_s, ref = best_of(lambda: st.encode(texts, batch_size=args.batch_size), args.repeats)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_seqs=256,
              max_num_batched_tokens=8192)
    ours_s, outs = best_of(lambda: llm.embed(texts), args.repeats)
    ours = np.stack([o.pooled.numpy() for o in outs])
    record = {
        "workload": "256 sentences, 8-128 tokens (bench/embeddings.py, seed 0)",
        "dtype": "float32", "threads": args.threads, "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg(),
        "sentence_transformers_per_s": len(texts) / st_s,
        "offline_per_s": len(texts) / ours_s,
        "offline_ratio": st_s / ours_s,
        "offline_min_cosine": float(cosines(ours, ref).min()),
    }
    if not args.no_server:
        served_s, served = through_server(texts, args.repeats, args.threads)
        record.update(server_per_s=len(texts) / served_s, server_ratio=st_s / served_s,
                      server_min_cosine=float(cosines(served, ref).min()))
    print(json.dumps(record, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1))
    ok = record["offline_min_cosine"] >= 0.9999 and record.get("server_min_cosine", 1) >= 0.9999
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
