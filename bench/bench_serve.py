"""Serving benchmark against any OpenAI-compatible completions endpoint (ours, vLLM, ...).

Streams every request (SSE) and measures, per request, TTFT, TPOT, inter-token gaps and
end-to-end latency, then request and token throughput over the run. Prompts are sent as
token-id lists, so every server sees byte-identical input whatever its tokenizer does with
text; greedy, `ignore_eos`, each request's own `max_tokens`. Arrivals: all at once (default) or
a seeded Poisson process at `--request-rate`, capped at `--max-concurrency` requests in flight.

    # our server (KServe mounts the OpenAI routes under /openai/v1)
    python bench/bench_serve.py --base-url http://127.0.0.1:8080 \
        --endpoint /openai/v1/completions --model smol --workload random
    # vLLM
    python bench/bench_serve.py --base-url http://127.0.0.1:8000 \
        --endpoint /v1/completions --model smol --workload random --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    WORKLOAD_NAMES,
    RequestRecord,
    load_workload,
    poisson_arrivals,
    summarize,
    synthetic_workload,
)

OURS_ENDPOINT = "/openai/v1/completions"
VLLM_ENDPOINT = "/v1/completions"


def request_body(model: str, req: dict, extra: dict | None = None) -> dict:
    """The completions body: token-id prompt, greedy, EOS ignored, usage in the last chunk."""
    body = {"model": model, "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if extra:
        body.update(extra)
    return body


def parse_sse_line(raw: bytes | str) -> dict | None:
    """The JSON payload of one `data:` line; None for blank lines, comments and `[DONE]`."""
    line = raw.decode() if isinstance(raw, bytes) else raw
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


async def send_one(session: aiohttp.ClientSession, url: str, body: dict) -> RequestRecord:
    """POST one streamed completion and time every text chunk as it arrives."""
    rec = RequestRecord(start=time.perf_counter(), prompt_tokens=len(body["prompt"]))
    chunks = 0
    usage = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                data = parse_sse_line(raw)
                if data is None:
                    continue
                if "error" in data:
                    rec.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    break
                choices = data.get("choices") or []
                if choices and choices[0].get("text"):
                    rec.chunk_times.append(time.perf_counter())
                    chunks += 1
                if data.get("usage"):
                    usage = data["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end = time.perf_counter()
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
    else:
        rec.output_tokens = chunks
    if rec.error is None and rec.output_tokens == 0:
        rec.error = "no output tokens"
    return rec


async def run_benchmark(base_url: str, endpoint: str, model: str, reqs: list[dict], *,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        seed: int = 0, warmup: int = 1, progress: bool = True,
                        timeout_s: float = 3600.0, extra_body: dict | None = None,
                        label: str = "", keep_alive: bool = True) -> dict:
    """Run the workload once; returns the summary, the settings and the per-request samples."""
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    # keep_alive False: a connection per request, for a server that closes idle ones early
    # (llama-server), where reusing a closed one fails the request's write.
    conn = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        for i in range(warmup):  # short, unrelated: connection set-up and first-request costs
            w = synthetic_workload(1, 128, 8, seed=10_000 + i)[0]
            rec = await send_one(session, url, request_body(model, w, extra_body))
            if not rec.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {rec.error}")
        offsets = poisson_arrivals(len(reqs), request_rate, seed)
        bar = tqdm(total=len(reqs), desc=label or "requests", disable=not progress,
                   dynamic_ncols=True)

        async def paced(i: int) -> RequestRecord:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(model, reqs[i], extra_body)
            if sem is None:
                rec = await send_one(session, url, body)
            else:
                async with sem:
                    rec = await send_one(session, url, body)
            bar.update(1)
            return rec

        t0 = time.perf_counter()
        records = await asyncio.gather(*(paced(i) for i in range(len(reqs))))
        duration = time.perf_counter() - t0
        bar.close()
    summary = summarize(records, duration)
    errors = sorted({r.error for r in records if r.error})[:5]
    return {
        "base_url": base_url, "endpoint": endpoint, "model": model,
        "num_prompts": len(reqs), "request_rate": None if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency, "seed": seed,
        "requested_output_tokens": sum(r["max_tokens"] for r in reqs),
        **summary,
        "errors": errors,
        "samples": {
            "ttft_ms": [r.ttft * 1000 for r in records if r.ok and r.ttft is not None],
            "tpot_ms": [r.tpot * 1000 for r in records if r.ok and r.tpot is not None],
            "e2e_ms": [r.e2e * 1000 for r in records if r.ok],
            "itl_ms": [g * 1000 for r in records if r.ok for g in r.itls],
        },
        "loadavg_end": os.getloadavg(),
    }


def build_workload(args: argparse.Namespace) -> list[dict]:
    if args.workload in WORKLOAD_NAMES:
        return load_workload(args.workload, args.num_prompts, args.max_tokens)
    return synthetic_workload(args.num_prompts or 64, args.input_len,
                              args.max_tokens or args.output_len, args.seed)


def format_summary(res: dict) -> str:
    """A few human lines; the JSON holds the rest."""
    def f(d: dict, k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{v:.1f}"

    lines = [f"completed {res['completed']}/{res['num_prompts']} in {res['duration_s']:.2f} s "
             f"({res['failed']} failed)",
             f"throughput: {res['request_throughput'] or 0:.2f} req/s, "
             f"{res['output_throughput'] or 0:.1f} output tok/s, "
             f"{res['total_token_throughput'] or 0:.1f} total tok/s"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = res[name]
        lines.append(f"{name[:-3].upper():>5} ms: mean {f(d, 'mean')}  p50 {f(d, 'p50')}  "
                     f"p99 {f(d, 'p99')}")
    if res["errors"]:
        lines.append(f"errors: {res['errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--endpoint", default=OURS_ENDPOINT,
                    help=f"ours: {OURS_ENDPOINT}; vLLM: {VLLM_ENDPOINT}")
    ap.add_argument("--model", default="smol", help="the model name the server serves")
    ap.add_argument("--workload", choices=[*WORKLOAD_NAMES, "synthetic"], default="random",
                    help="random (W1) / shared (W2) from bench/workloads, or synthetic")
    ap.add_argument("--num-prompts", type=int, default=None, help="first N requests only")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every output at N")
    ap.add_argument("--input-len", type=int, default=256, help="synthetic prompt length")
    ap.add_argument("--output-len", type=int, default=128, help="synthetic output length")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals per second (default inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    reqs = build_workload(args)
    res = asyncio.run(run_benchmark(
        args.base_url, args.endpoint, args.model, reqs, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, seed=args.seed, warmup=args.warmup,
        progress=not args.no_progress, label=args.workload))
    res["workload"] = args.workload
    print(format_summary(res))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
