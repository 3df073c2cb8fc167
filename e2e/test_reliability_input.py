"""Hostile input against one real server (issue 8, parts 2 and 7).

Every malformed, out-of-range or oversized request on the v2 and OpenAI routes must get a 4xx
with a message (never a 500, never a hang: every call has a client timeout), the server must
stay ready, and nothing may stay behind in the engine (no running request, no KV block held).
Then schemathesis fuzzes every route of the server's own /openapi.json.

Unknown fields (decided here, as vLLM does): ignored, with a warning in the server log. Known
options the engine cannot honour (best_of != n, suffix, beam search, ...) are 400s, and so are
invalid constraints (a broken schema, regex or grammar; tools that are not functions).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.e2e_server import MODEL, Server, record, running_server, wait_idle
from tests.helpers.hostile_requests import (
    BAD,
    CHAT,
    CMPL,
    GOOD,
    LONG,
    MAX_MODEL_LEN,
    MB,
    NESTED,
    V2,
    binary_v2,
    chat,
    cmpl,
    v2,
)

CLIENT_TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # LoRA runtime updates stay off here (the LoRA routes answer their documented 404): with
    # LoRA on, every step takes the slower per-layer path, and the fuzzing's generating calls
    # would not fit its time. test_reliability_new_surface.py loads adapters for real.
    with running_server(engine_opts={"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 32}) as srv:
        yield srv


def _post(client: httpx.Client, path: str, body: Any, headers: dict[str, str]
          ) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body,
                           headers={"content-type": "application/json", **headers})
    return client.post(path, json=body, headers=headers)


def _message(path: str, r: httpx.Response) -> str:
    """The error message, in the route's error shape (OpenAI's object or v2's string)."""
    err = r.json()["error"]
    if path.startswith("/openai"):
        assert err["type"], r.text
        return err["message"]
    assert isinstance(err, str), r.text
    return err


def test_hostile_requests_get_4xx_with_a_message_and_leave_nothing_behind(server: Server):
    codes: Counter[int] = Counter()
    failures = []
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as client:
        for name, path, body, headers in BAD:
            r = _post(client, path, body, headers)
            codes[r.status_code] += 1
            if not 400 <= r.status_code < 500:
                failures.append((name, r.status_code, r.text[:300]))
                continue
            try:
                assert _message(path, r)
            except (AssertionError, KeyError, ValueError):
                failures.append((name, r.status_code, f"no message: {r.text[:300]}"))
        assert not failures, failures
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
        for name, path, body, headers in GOOD:
            r = _post(client, path, body, headers)
            codes[r.status_code] += 1
            if r.status_code != 200:
                failures.append((name, r.status_code, r.text[:300]))
        assert not failures, failures
    _, m = wait_idle(server, timeout=5)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    log = server.log()
    assert "ignoring unknown field(s) ['unknown_field']" in log
    assert "ignoring unknown v2 parameter(s) ['bogus_option']" in log
    record("hostile_input", requests=len(BAD) + len(GOOD), refused=len(BAD),
           accepted=len(GOOD), codes=dict(sorted(codes.items())))


def test_known_issue_messages_are_specific(server: Server):
    """Spot checks that the 4xx says what is wrong (not just that something is)."""
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as client:
        expectations = [
            (CMPL, cmpl(prompt=LONG), f"maximum context length is {MAX_MODEL_LEN}"),
            (CMPL, cmpl(max_tokens=10**12), "maximum context length"),
            (V2, v2(parameters={"cache_salt": 5}), "cache_salt must be a string"),
            (V2, v2([1]), "must hold strings"),
            (CMPL, b'{"model": "smol", "prompt": "\\ud800"}', "lone surrogate"),
            (CMPL, NESTED, "nested too deeply"),
            (V2, *binary_v2(struct.pack("<I", 3) + b"\xff\xfe\xfd")),
        ]
        for path, body, *rest in expectations:
            headers = rest[0] if isinstance(rest[0], dict) else {}
            needle = rest[-1] if isinstance(rest[-1], str) else "not valid UTF-8"
            r = _post(client, path, body, headers)
            assert r.status_code == 400 and needle in _message(path, r), (path, r.text[:300])


# Issue 16: tokenizing this (to find it too long) froze every other request for ~10 s.
HUGE = ("The quick brown fox jumps over the lazy dog. " * (20 * MB // 45 + 1))[:20 * MB]
MAX_REQUEST_BYTES = 32 * MB  # the server's default --max_request_bytes


def _timed(client: httpx.Client, path: str, body: Any) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = _post(client, path, body, {})
    return r, time.monotonic() - start


def test_a_20mb_prompt_is_refused_without_stalling_a_concurrent_request(server: Server):
    """A 20 MB prompt on each protocol gets its 400 (too long to tokenize) while a small
    request sent at the same time completes about as fast as alone: relative to the small
    request's own latency, with a generous margin for a loaded machine."""
    small = cmpl(prompt="Hello", max_tokens=2)
    figures: dict[str, Any] = {}
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as client, \
            httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as big_client, \
            ThreadPoolExecutor(1) as pool:
        baseline = max(_timed(client, CMPL, small)[1] for _ in range(3))
        bound = 3 * baseline + 2.0
        for name, path, body in (("completions", CMPL, cmpl(prompt=HUGE)),
                                 ("chat", CHAT, chat(HUGE)), ("v2", V2, v2([HUGE]))):
            raw = json.dumps(body).encode()
            big = pool.submit(_timed, big_client, path, raw)
            time.sleep(0.02)  # the big body is on its way
            r, small_s = _timed(client, CMPL, small)
            big_r, big_s = big.result(timeout=60)
            assert r.status_code == 200, r.text[:300]
            assert small_s < bound, (name, small_s, big_s, baseline)
            assert big_r.status_code == 400, big_r.text[:300]
            assert "more than this server tokenizes" in _message(path, big_r), big_r.text[:300]
            assert big_s < bound + 5.0, (name, big_s)  # refused, not tokenized (was ~10 s)
            figures[name] = {"small_s": round(small_s, 3), "big_s": round(big_s, 3)}
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
    wait_idle(server, timeout=5)
    record("huge_prompt", baseline_s=round(baseline, 3), **figures)


def test_a_body_over_max_request_bytes_is_413_on_both_protocols(server: Server):
    prompt = "x" * (MAX_REQUEST_BYTES + MB)
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT) as client:
        for path, body in ((CMPL, cmpl(prompt=prompt)), (V2, v2([prompt]))):
            r = _post(client, path, json.dumps(body).encode(), {})
            assert r.status_code == 413, r.text[:300]
            assert "more than this server accepts" in _message(path, r)
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200


FUZZ_LIMIT_S = 1500  # every route's cases, on a shared 2-core machine


@pytest.mark.timeout(FUZZ_LIMIT_S + 60)  # over the suite's 600 s: the subprocess has its own
def test_schemathesis_fuzzing_of_every_route(server: Server):
    """Generated from /openapi.json, every operation it publishes (tests/helpers/fuzz.py:
    OpenAI, LoRA, KServe v1/v2, and routes added later): no 5xx, and statuses, content types,
    JSON bodies and SSE events as the document says, errors included.

    In a fresh interpreter: a library loaded earlier in a pytest run may set the CPU's
    flush-to-zero mode, and hypothesis then refuses to generate floats."""
    code = ("import json, sys; from tests.helpers.fuzz import fuzz_every_route; "
            "print('CALLS', json.dumps(fuzz_every_route(sys.argv[1], sys.argv[2])))")
    proc = subprocess.run([sys.executable, "-c", code, server.url, MODEL], capture_output=True,
                          text=True, timeout=FUZZ_LIMIT_S, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(proc.stdout.rsplit("CALLS ", 1)[1])
    calls, operations = result["codes"], result["operations"]
    record("schemathesis", calls=sum(calls.values()), codes=calls,
           operations=len(operations), excluded=result["excluded"], per_operation=operations)
    assert not any(int(code) >= 500 for code in calls), calls
    published = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    for route in ("/openai/v1/completions", "/openai/v1/chat/completions",
                  "/openai/v1/load_lora_adapter", "/openai/v1/unload_lora_adapter",
                  "/v2/models/{model_name}/infer"):
        assert route in published and any(op.endswith(" " + route) for op in operations), route
    wait_idle(server, timeout=5)
