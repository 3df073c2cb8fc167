"""Reliability under load, against one real server with a tiny KV pool (issue 8, parts 1, 3, 6).

- Overload: far more concurrent greedy streams than the KV pool holds. Every stream must
  complete with exactly the offline greedy text, the engine must have preempted (and counted
  it), and a second identical round must not grow the server's resident memory.
- Disconnect storm: many clients vanish mid-stream at once; their KV blocks must be free
  within about one engine step.
- Tenant isolation: identical prompts under different ``x-cache-salt`` never share prefix-cache
  blocks; the same salt does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from kserve_paged_engine import SamplingParams
from tests.helpers.e2e_server import (
    MODEL,
    Server,
    record,
    rss_bytes,
    running_server,
    scrape,
    wait_idle,
)

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 64  # 1024 token slots: about 7 of the requests below at once
MAX_MODEL_LEN = 256
NUM_STREAMS = 24  # over three times what the pool holds at once
MAX_TOKENS = 32
REQUEST_TIMEOUT_S = 300.0  # a round takes well under a minute on 2 quiet cores, far more when shared
# Round 2 may not exceed round 1's resident memory by more than this: 5% of the ~1.15 GiB
# resident set. Round to round the allocators swing by about +-20 MiB (six rounds measured:
# 1155-1175 MiB, no trend); a leak of 2.7 MiB per request would cross it.
RSS_GROWTH_BOUND = 64 << 20
WORDS = ["river", "mountain", "silver", "quiet", "lantern", "harbor", "meadow", "thunder",
         "velvet", "orchard", "copper", "whisper", "glacier", "ember", "falcon", "prairie",
         "canyon", "willow", "marble", "tide"]


def prompt(i: int) -> str:
    """About 100 tokens, different for every i (a few share leading blocks, as real traffic
    does)."""
    return f"Note {i}: " + " ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)]
                                    for j in range(85))


PROMPTS = [prompt(i) for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(engine_opts={"max_model_len": MAX_MODEL_LEN,
                                     "num_kv_blocks": NUM_KV_BLOCKS,
                                     "block_size": BLOCK_SIZE}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """Offline greedy texts (float32, prefix caching on, as the server; a pool big enough for
    all prompts at once, so the reference itself is never preempted)."""
    from kserve_paged_engine import LLM

    llm = LLM(max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_STREAMS * 10, dtype="float32",
              enable_prefix_caching=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


async def _stream(client: httpx.AsyncClient, text: str) -> tuple[int, str, str | None]:
    """One streaming completion: (status, concatenated text, error message if any)."""
    body = {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pieces: list[str] = []
    async with client.stream("POST", "/openai/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", (await r.aread()).decode(errors="replace")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return r.status_code, "".join(pieces), chunk["error"]["message"]
            pieces.append(chunk["choices"][0]["text"])
    return 200, "".join(pieces), None


async def _round(srv: Server) -> tuple[list[tuple[int, str, str | None]], int]:
    """All streams at once; returns their results and the peak number of running requests."""
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=timeout) as client:
        tasks = [asyncio.ensure_future(_stream(client, p)) for p in PROMPTS]
        peak_waiting = 0
        while not all(t.done() for t in tasks):
            m = (await client.get("/metrics")).text
            for line in m.splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    peak_waiting = max(peak_waiting, int(float(line.split()[-1])))
            await asyncio.sleep(0.5)
        return [t.result() for t in tasks], peak_waiting


def test_overload_all_complete_exactly_with_preemption_and_no_memory_growth(
        server: Server, reference: list[str]):
    pid = server.proc.pid
    before = scrape(server)
    rss_start = rss_bytes(pid)
    rounds = []
    for n in (1, 2):
        started = time.monotonic()
        results, peak_waiting = asyncio.run(_round(server))
        seconds = time.monotonic() - started
        wait_idle(server, timeout=10)
        codes = Counter(status for status, _, _ in results)
        errors = [err for _, _, err in results if err]
        assert codes == {200: NUM_STREAMS} and not errors, (codes, errors[:3])
        mismatched = [i for i, (_, text, _) in enumerate(results) if text != reference[i]]
        assert not mismatched, [(i, results[i][1], reference[i]) for i in mismatched[:3]]
        m = scrape(server)
        rounds.append({"round": n, "seconds": round(seconds, 1), "completed": len(results),
                       "errors": dict(codes - Counter({200: NUM_STREAMS})),
                       "peak_waiting": peak_waiting,
                       "preemptions_total": m["vllm:num_preemptions_total"],
                       "rss_mib": round(rss_bytes(pid) / 2**20, 1),
                       "peak_rss_mib": round(rss_bytes(pid, "VmHWM") / 2**20, 1)})
        assert peak_waiting > 0, "the pool never overflowed: the test does not overload"
    preemptions = rounds[-1]["preemptions_total"] - before["vllm:num_preemptions_total"]
    assert preemptions > 0, rounds
    assert rounds[0]["preemptions_total"] > before["vllm:num_preemptions_total"], rounds
    growth = (rounds[1]["rss_mib"] - rounds[0]["rss_mib"]) * 2**20
    record("overload", streams_per_round=NUM_STREAMS, max_tokens=MAX_TOKENS,
           num_kv_blocks=NUM_KV_BLOCKS, preemptions=preemptions,
           rss_start_mib=round(rss_start / 2**20, 1), rounds=rounds,
           rss_growth_bound_mib=RSS_GROWTH_BOUND / 2**20)
    assert growth <= RSS_GROWTH_BOUND, rounds


async def _storm(srv: Server, n: int) -> None:
    """n streams read two chunks each, then all drop at once."""
    limits = httpx.Limits(max_connections=n + 4)
    drop = asyncio.Event()
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        body = {"model": MODEL, "prompt": f"Client {i} tells a long story:", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0.7, "stream": True}
        async with httpx.AsyncClient(base_url=srv.url, limits=limits,
                                     timeout=httpx.Timeout(60)) as client, \
                client.stream("POST", "/openai/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 2:
                    break
            ready += 1
            if ready == n:
                drop.set()
            await asyncio.wait_for(drop.wait(), 60)
        # leaving the blocks closes the response and the connection mid-stream

    await asyncio.gather(*(one(i) for i in range(n)))


def test_disconnect_storm_frees_every_block_within_a_step(server: Server):
    n = 20
    wait_idle(server, timeout=10)
    before = scrape(server)
    asyncio.run(_storm(server, n))
    freed_after, m = wait_idle(server, timeout=30)
    # "About one engine step": 2 s, or three mean decode steps of this storm when a busy
    # machine makes steps slower than that.
    steps = (m["vllm:inter_token_latency_seconds_count"]
             - before["vllm:inter_token_latency_seconds_count"])
    step_s = (m["vllm:inter_token_latency_seconds_sum"]
              - before["vllm:inter_token_latency_seconds_sum"]) / max(steps, 1)
    bound = max(2.0, 3 * step_s)
    record("disconnect_storm", clients=n, seconds_to_idle=round(freed_after, 2),
           mean_step_s=round(step_s, 3), bound_s=round(bound, 2))
    assert freed_after <= bound, f"blocks freed only after {freed_after:.2f}s (step {step_s:.2f}s)"
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0


def test_tenants_never_share_prefix_cache_blocks(server: Server):
    text = ("Tenant isolation check. " + " ".join(WORDS) + " ") * 3  # > 4 full blocks
    wait_idle(server, timeout=10)

    def ask(salt: str | None) -> tuple[int, float]:
        headers = {"x-cache-salt": salt} if salt else {}
        r = httpx.post(f"{server.url}/openai/v1/completions", headers=headers, timeout=60,
                       json={"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached, scrape(server)["vllm:prefix_cache_hits_total"]

    _, hits0 = ask("tenant-a")
    cached_b, hits_b = ask("tenant-b")
    cached_none, hits_none = ask(None)
    cached_a, hits_a = ask("tenant-a")
    record("tenant_isolation", hits_other_tenant=hits_b - hits0,
           hits_unsalted=hits_none - hits_b, hits_same_tenant=hits_a - hits_none)
    assert cached_b == 0 and hits_b == hits0, "tenant b hit tenant a's blocks"
    assert cached_none == 0 and hits_none == hits_b, "an unsalted request hit a salted block"
    assert cached_a >= 4 * BLOCK_SIZE and hits_a - hits_none == cached_a
