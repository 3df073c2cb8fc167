"""Issue 49: can one request make another wait? A small completions request (16 greedy tokens)
timed alone, then while clients send requests of the same shape without lists (benign), then
while they send hostile ones, kind by kind and all at once:

- allowed_token_ids of --max_allowed_token_ids entries (its default: the vocabulary size;
  ids 10-99, repeated);
- bad_words of --max_bad_words words;
- a prompt of 4,000,000 token ids (the issue's; refused by --max_prompt_token_ids).

The property: the small request's time with hostile requests stays within ~2x its time alone
(and near its time beside benign ones). Each kind is sent once first: a kind the server runs
(200) is then sent again as soon as the last one ended, for as long as the small request is
timed, so one is always running beside it; a kind it refuses (the prompt of ids; the lists
over the caps with --allowed / --bad-words above them) is sent as each small request starts,
once per small request (a flood of refused requests is a matter of rate limits, not of one
request's cost). Bodies are encoded once: the client shares the machine's cores with the
server. Each setting's alone times are taken just before it.

    python bench/bench_stall.py                       # starts the default model's server
    python bench/bench_stall.py --src /tmp/old-tree   # the server of another checkout
    python bench/bench_stall.py --url http://127.0.0.1:8080 --model smol
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from kserve_paged.testing import ServerProcess, free_port
from kserve_paged_engine import limits as L

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
         "ignore_eos": True}
HOSTILE_TOKENS = 32  # each hostile request's output: it runs steps beside the small one
PROMPT_IDS = 4_000_000
SMOL_VOCAB = 49_152  # the default model's vocabulary


def bodies(model: str, allowed: int, bad_words: int) -> dict[str, bytes]:
    """Each kind's request body, encoded once."""
    base = {"model": model, "prompt": "Write a long story about a dragon.",
            "max_tokens": HOSTILE_TOKENS, "temperature": 1.0, "ignore_eos": True}
    words = [f"zq{i}x" for i in range(bad_words)]
    kinds = {
        "benign": base,
        # two-digit ids: 8M of them (the issue's) fit the default 32 MiB body limit
        "allowed_token_ids": {**base, "allowed_token_ids": [10 + i % 90 for i in range(allowed)]},
        "bad_words": {**base, "bad_words": words},
    }
    out = {k: json.dumps(v).encode() for k, v in kinds.items()}
    head = json.dumps({"model": model, "max_tokens": HOSTILE_TOKENS})[:-1]
    out["prompt_ids"] = (head + ', "prompt": [' + ",".join(["1"] * PROMPT_IDS) + "]}").encode()
    return out


async def small_request(client: httpx.AsyncClient, model: str) -> float:
    t0 = time.perf_counter()
    r = await client.post("/openai/v1/completions", json={"model": model, **SMALL})
    r.raise_for_status()
    return time.perf_counter() - t0


async def hostile_loop(client: httpx.AsyncClient, body: bytes, stop: asyncio.Event,
                       statuses: dict[int, int]) -> None:
    while not stop.is_set():
        await post(client, body, statuses)


async def post(client: httpx.AsyncClient, body: bytes, statuses: dict[int, int]) -> int:
    r = await client.post("/openai/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    return r.status_code


async def refused_kinds(url: str, body: dict[str, bytes]) -> set[str]:
    """The kinds the server does not run (any answer but 200), each sent once."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        statuses: dict[int, int] = {}
        return {k for k in body if await post(client, body[k], statuses) != 200}


async def measure(url: str, model: str, kinds: list[str], body: dict[str, bytes],
                  repeats: int, clients: int, settle_s: float, once: set[str] = frozenset()
                  ) -> dict:
    """The small request's times with `clients` clients of each of `kinds` beside it: those
    in `once` sent with each small request, the others running throughout."""
    limits = httpx.Limits(max_connections=64)
    looping = [k for k in kinds if k not in once]
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        statuses: dict[int, int] = {}
        tasks = [asyncio.create_task(hostile_loop(client, body[k], stop, statuses))
                 for k in looping for _ in range(clients)]
        if tasks:
            await asyncio.sleep(settle_s)  # admitted and decoding before the first timing
        times = []
        for _ in range(repeats):
            sent = [asyncio.create_task(post(client, body[k], statuses))
                    for k in kinds if k in once for _ in range(clients)]
            times.append(await small_request(client, model))
            await asyncio.gather(*sent)
        stop.set()
        await asyncio.gather(*tasks)
    return {"times_s": times, "median_s": statistics.median(times),
            "hostile_statuses": statuses}


def server_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict, str]:
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", args.model,
           "--http_port", str(port), *args.server_args]
    env = dict(os.environ)
    cwd = str(ROOT)
    if args.src:
        src = str(Path(args.src).resolve())
        env["PYTHONPATH"] = os.pathsep.join([src, f"{src}/engine", f"{src}/kernels"])
        cwd = src
    return cmd, env, cwd


async def run_all(url: str, args: argparse.Namespace) -> dict:
    """Each setting's small-request times, each beside its own alone times taken just before
    (the machine is shared: a baseline from minutes earlier would mislead)."""
    body = bodies(args.model, args.allowed, args.bad_words)
    plan = [("benign", ["benign"]),
            *[(k, [k]) for k in ("allowed_token_ids", "bad_words", "prompt_ids")],
            ("all hostile", ["allowed_token_ids", "bad_words", "prompt_ids"])]
    await measure(url, args.model, [], body, 2, args.clients, 0)  # warm-up
    once = await refused_kinds(url, body)
    print(f"refused, so sent once per small request: {sorted(once)}", flush=True)
    results = {}
    for name, kinds in plan:
        if args.only and name not in args.only:
            continue
        alone = await measure(url, args.model, [], body, args.repeats, args.clients, 0)
        beside = await measure(url, args.model, kinds, body, args.repeats, args.clients,
                               args.settle_s, once)
        ratio = beside["median_s"] / alone["median_s"]
        results[name] = {"alone": alone, "beside": beside, "ratio": ratio}
        print(f"{name:>18}: alone {alone['median_s']:6.2f} s {_rounded(alone)}  beside "
              f"{beside['median_s']:6.2f} s {_rounded(beside)}  x{ratio:5.2f}  hostile "
              f"answers {beside['hostile_statuses']}", flush=True)
    return results


def _rounded(result: dict) -> list[float]:
    return [round(t, 2) for t in result["times_s"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (else one is started)")
    ap.add_argument("--model", default="smol", help="served model name")
    ap.add_argument("--src", default=None,
                    help="start the server of this checkout (its kserve_paged/, engine/, "
                         "kernels/) instead of this one")
    ap.add_argument("--allowed", type=int, default=SMOL_VOCAB,
                    help="entries of the hostile allowed_token_ids (default: the default "
                         "model's vocabulary size, the cap's default there)")
    ap.add_argument("--bad-words", type=int, default=L.DEFAULT_MAX_BAD_WORDS,
                    help="words of the hostile bad_words")
    ap.add_argument("--repeats", type=int, default=5,
                    help="small requests per setting, alone and beside")
    ap.add_argument("--clients", type=int, default=1, help="clients per hostile kind")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--only", nargs="+", default=None,
                    choices=("benign", "allowed_token_ids", "bad_words", "prompt_ids",
                             "all hostile"), help="these settings only")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument("server_args", nargs="*", help="more server flags (after --)")
    args = ap.parse_args(argv)
    if args.url:
        results = asyncio.run(run_all(args.url, args))
    else:
        port = free_port()
        cmd, env, cwd = server_command(args, port)
        url = f"http://127.0.0.1:{port}"
        with ServerProcess(cmd, [f"{url}/v2/models/{args.model}/ready"], env=env, cwd=cwd,
                           log_path=args.out and f"{args.out}.server.log") as srv:
            print(f"server ready after {srv.time_to_ready_s:.1f} s ({args.src or ROOT})",
                  flush=True)
            results = asyncio.run(run_all(url, args))
    worst = max(r["ratio"] for k, r in results.items() if k != "benign")
    print(f"worst hostile / alone: x{worst:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
