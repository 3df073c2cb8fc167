"""Hostile input against one real server (issue 8, parts 2 and 7).

Every malformed, out-of-range or oversized request on the v2 and OpenAI routes must get a 4xx
with a message (never a 500, never a hang: every call has a client timeout), the server must
stay ready, and nothing may stay behind in the engine (no running request, no KV block held).
Then schemathesis fuzzes the OpenAI routes from the server's own /openapi.json.

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

MAX_MODEL_LEN = 64  # small: fuzzed requests without max_tokens generate the rest of it
CLIENT_TIMEOUT = httpx.Timeout(30.0)
V2 = f"/v2/models/{MODEL}/infer"
CMPL = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
MB = 1 << 20
FUZZ_MAX_N = 4


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(engine_opts={"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 32}) as srv:
        yield srv


def v2(data: Any = None, parameters: dict[str, Any] | None = None, **tensor: Any
       ) -> dict[str, Any]:
    t = {"name": "text_input", "datatype": "BYTES", "shape": [1],
         "data": ["Hi"] if data is None else data, **tensor}
    body: dict[str, Any] = {"inputs": [t]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def chat(content: Any = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **fields}


def binary_v2(raw: bytes, *, size: int | None = None, header_length: str | None = None
              ) -> tuple[bytes, dict[str, str]]:
    """A tritonclient-style binary request: JSON header, then the BYTES tensor."""
    header = json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(raw) if size is None
                                                    else size}}],
                         "parameters": {"max_tokens": 2}}).encode()
    return header + raw, {"inference-header-content-length": header_length or str(len(header)),
                          "content-type": "application/octet-stream"}


def _bytes(s: str) -> bytes:
    return struct.pack("<I", len(s.encode())) + s.encode()


NESTED = b"[" * 100_000 + b"]" * 100_000
LONG = "hello " * 200  # > MAX_MODEL_LEN tokens
MEGA = "x" * MB

# (id, path, body: JSON-able or raw bytes, extra headers)
BAD: list[tuple[str, str, Any, dict[str, str]]] = [
    # v2: body
    ("v2-invalid-json", V2, b'{"inputs": [', {}),
    ("v2-non-utf8-body", V2, b"\xff\xfe\x00", {}),
    ("v2-empty-body", V2, b"", {}),
    ("v2-array-body", V2, b"[]", {}),
    ("v2-nested-bomb", V2, NESTED, {}),
    ("v2-no-inputs", V2, {}, {}),
    ("v2-empty-inputs", V2, {"inputs": []}, {}),
    ("v2-inputs-not-list", V2, {"inputs": "x"}, {}),
    ("v2-input-without-name", V2, {"inputs": [{"datatype": "BYTES", "shape": [1],
                                               "data": ["a"]}]}, {}),
    ("v2-wrong-input-name", V2, v2(name="other"), {}),
    # v2: datatype and shape
    ("v2-int32", V2, v2([1], datatype="INT32"), {}),
    ("v2-fp32", V2, v2([1.5], datatype="FP32"), {}),
    ("v2-bytes-holding-int", V2, v2([1]), {}),
    ("v2-bytes-holding-null", V2, v2([None]), {}),
    ("v2-bytes-holding-object", V2, v2([{"a": 1}]), {}),
    ("v2-shape-too-big", V2, v2(["a"], shape=[2]), {}),
    ("v2-shape-huge", V2, v2(["a"], shape=[10**12]), {}),
    ("v2-shape-negative", V2, v2(["a"], shape=[-1]), {}),
    ("v2-shape-string", V2, v2(["a"], shape=["x"]), {}),
    ("v2-no-data", V2, {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                    "shape": [1]}]}, {}),
    # v2: prompts
    ("v2-empty-string", V2, v2([""]), {}),
    ("v2-lone-surrogate", V2, b'{"inputs": [{"name": "text_input", "datatype": "BYTES", '
                              b'"shape": [1], "data": ["\\ud800"]}]}', {}),
    ("v2-prompt-too-long", V2, v2([LONG]), {}),
    ("v2-megabyte-prompt", V2, v2([MEGA]), {}),
    # v2: parameters
    ("v2-max-tokens-enormous", V2, v2(parameters={"max_tokens": 10**12}), {}),
    ("v2-max-tokens-negative", V2, v2(parameters={"max_tokens": -1}), {}),
    ("v2-max-tokens-float", V2, v2(parameters={"max_tokens": 2.5}), {}),
    ("v2-max-tokens-bool", V2, v2(parameters={"max_tokens": True}), {}),
    ("v2-max-tokens-text", V2, v2(parameters={"max_tokens": "abc"}), {}),
    ("v2-temperature-negative", V2, v2(parameters={"temperature": -1}), {}),
    ("v2-temperature-nan-text", V2, v2(parameters={"temperature": "nan"}), {}),
    ("v2-temperature-NaN", V2, b'{"inputs": [{"name": "text_input", "datatype": "BYTES", '
                               b'"shape": [1], "data": ["a"]}], '
                               b'"parameters": {"temperature": NaN}}', {}),
    ("v2-temperature-inf", V2, v2(parameters={"temperature": "inf"}), {}),
    ("v2-top-p-zero", V2, v2(parameters={"top_p": 0}), {}),
    ("v2-top-p-above-1", V2, v2(parameters={"top_p": 2}), {}),
    ("v2-top-k-negative", V2, v2(parameters={"top_k": -5}), {}),
    ("v2-min-p-above-1", V2, v2(parameters={"min_p": 1.5}), {}),
    ("v2-seed-text", V2, v2(parameters={"seed": "x"}), {}),
    ("v2-min-tokens-over-max", V2, v2(parameters={"max_tokens": 2, "min_tokens": 5}), {}),
    ("v2-stop-empty", V2, v2(parameters={"stop": ""}), {}),
    ("v2-stop-token-ids-text", V2, v2(parameters={"stop_token_ids": "a,b"}), {}),
    ("v2-stop-token-ids-negative", V2, v2(parameters={"stop_token_ids": "-1"}), {}),
    ("v2-priority-text", V2, v2(parameters={"priority": "x"}), {}),
    ("v2-cache-salt-int", V2, v2(parameters={"cache_salt": 5}), {}),
    ("v2-num-beams", V2, v2(parameters={"num_beams": 4}), {}),
    # v2: binary bodies
    ("v2-binary-non-utf8", V2, *binary_v2(struct.pack("<I", 3) + b"\xff\xfe\xfd")),
    ("v2-binary-truncated", V2, *binary_v2(_bytes("hello")[:6], size=9)),
    ("v2-binary-size-past-end", V2, *binary_v2(b"\x01\x00", size=100)),
    ("v2-binary-header-too-long", V2, *binary_v2(_bytes("hi"), header_length="999999")),
    ("v2-binary-header-negative", V2, *binary_v2(_bytes("hi"), header_length="-5")),
    ("v2-binary-header-text", V2, *binary_v2(_bytes("hi"), header_length="abc")),
    # OpenAI: body
    ("oai-invalid-json", CMPL, b'{"model": "smol", "prompt": ', {}),
    ("oai-non-utf8-body", CMPL, b'{"model": "smol", "prompt": "\xff\xfe"}', {}),
    ("oai-empty-body", CMPL, b"", {}),
    ("oai-array-body", CMPL, b"[]", {}),
    ("oai-nested-bomb", CMPL, NESTED, {}),
    ("oai-nested-bomb-in-prompt", CMPL, b'{"model": "smol", "prompt": ' + NESTED + b"}", {}),
    ("oai-control-char", CMPL, b'{"model": "smol", "prompt": "a\x00b"}', {}),
    ("oai-lone-surrogate", CMPL, b'{"model": "smol", "prompt": "\\ud800 hi"}', {}),
    ("oai-unknown-model", CMPL, cmpl(model="nope"), {}),
    ("oai-no-prompt", CMPL, {"model": MODEL}, {}),
    # OpenAI: prompts
    ("oai-empty-prompt", CMPL, cmpl(prompt=""), {}),
    ("oai-empty-prompt-list", CMPL, cmpl(prompt=[]), {}),
    ("oai-empty-token-list", CMPL, cmpl(prompt=[[]]), {}),
    ("oai-empty-string-in-list", CMPL, cmpl(prompt=["a", ""]), {}),
    ("oai-negative-token", CMPL, cmpl(prompt=[-1]), {}),
    ("oai-token-out-of-vocab", CMPL, cmpl(prompt=[10**9]), {}),
    ("oai-token-enormous", CMPL, cmpl(prompt=[10**30]), {}),
    ("oai-token-float", CMPL, cmpl(prompt=[1.5]), {}),
    ("oai-token-bool", CMPL, cmpl(prompt=[True]), {}),
    ("oai-mixed-prompt", CMPL, cmpl(prompt=["a", [1, 2]]), {}),
    ("oai-prompt-object", CMPL, cmpl(prompt={"a": 1}), {}),
    ("oai-prompt-null", CMPL, cmpl(prompt=None), {}),
    ("oai-prompt-too-long", CMPL, cmpl(prompt=LONG), {}),
    ("oai-megabyte-prompt", CMPL, cmpl(prompt=MEGA), {}),
    # OpenAI: sampling values
    ("oai-max-tokens-enormous", CMPL, cmpl(max_tokens=10**12), {}),
    ("oai-max-tokens-huge-int", CMPL, cmpl(max_tokens=10**30), {}),
    ("oai-max-tokens-negative", CMPL, cmpl(max_tokens=-1), {}),
    ("oai-max-tokens-fraction", CMPL, cmpl(max_tokens=2.5), {}),
    ("oai-temperature-NaN", CMPL, b'{"model": "smol", "prompt": "Hi", "temperature": NaN}', {}),
    ("oai-temperature-Infinity", CMPL,
     b'{"model": "smol", "prompt": "Hi", "temperature": Infinity}', {}),
    ("oai-temperature-overflow", CMPL, b'{"model": "smol", "prompt": "Hi", "temperature": 1e400}',
     {}),
    ("oai-temperature-negative", CMPL, cmpl(temperature=-0.5), {}),
    ("oai-top-p-above-1", CMPL, cmpl(top_p=1.5), {}),
    ("oai-top-k-negative", CMPL, cmpl(top_k=-7), {}),
    ("oai-min-p-negative", CMPL, cmpl(min_p=-1), {}),
    ("oai-min-tokens-negative", CMPL, cmpl(min_tokens=-3), {}),
    ("oai-min-tokens-over-max", CMPL, cmpl(min_tokens=10), {}),
    ("oai-stop-empty-string", CMPL, cmpl(stop=[""]), {}),
    ("oai-stop-not-strings", CMPL, cmpl(stop=[1, 2]), {}),
    ("oai-stop-token-negative", CMPL, cmpl(stop_token_ids=[-1]), {}),
    ("oai-stream-options-bad", CMPL, cmpl(stream=True, stream_options={"include_usage": "x"}),
     {}),
    ("oai-stream-options-without-stream", CMPL, cmpl(stream_options={"include_usage": True}),
     {}),
    ("oai-n-129", CMPL, cmpl(n=129), {}),
    ("oai-n-0", CMPL, cmpl(n=0), {}),
    ("oai-best-of-not-n", CMPL, cmpl(best_of=3), {}),
    ("oai-logprobs-21", CMPL, cmpl(logprobs=21), {}),
    ("oai-suffix", CMPL, cmpl(suffix="x"), {}),
    ("oai-penalty-out-of-range", CMPL, cmpl(presence_penalty=2.5), {}),
    ("oai-logit-bias-out-of-vocab", CMPL, cmpl(logit_bias={"99999999": 5}), {}),
    ("oai-logit-bias-over-100", CMPL, cmpl(logit_bias={"1": 101}), {}),
    ("oai-beam-search-streamed", CMPL, cmpl(use_beam_search=True, stream=True), {}),
    ("oai-json-mode-and-regex", CMPL, cmpl(response_format={"type": "json_object"},
                                            guided_regex="a+"), {}),
    ("oai-bad-regex", CMPL, cmpl(guided_regex="(a"), {}),
    ("oai-bad-grammar", CMPL, cmpl(structured_outputs={"grammar": "root ::= nothing"}), {}),
    ("oai-cache-salt-int", CMPL, cmpl(cache_salt=5), {}),
    ("oai-priority-text", CMPL, cmpl(priority="high"), {}),
    # chat
    ("chat-no-messages", CHAT, {"model": MODEL, "messages": []}, {}),
    ("chat-message-not-object", CHAT, {"model": MODEL, "messages": ["x"]}, {}),
    ("chat-role-int", CHAT, {"model": MODEL, "messages": [{"role": 5, "content": "x"}]}, {}),
    ("chat-content-int", CHAT, chat(5), {}),
    ("chat-image-part", CHAT, chat([{"type": "image_url", "image_url": {"url": "x"}}]), {}),
    ("chat-lone-surrogate", CHAT,
     b'{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}]}', {}),
    ("chat-too-long", CHAT, chat(LONG), {}),
    ("chat-megabyte", CHAT, chat(MEGA), {}),
    ("chat-max-completion-tokens-enormous", CHAT, chat(max_completion_tokens=10**12), {}),
    ("chat-tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "no spaces"}}]), {}),
    ("chat-tool-choice-unknown-function", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), {}),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), {}),
    ("chat-bad-json-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}), {}),
    ("chat-continue-and-generation-prompt", CHAT, chat(continue_final_message=True), {}),
]

# Accepted on purpose: unknown fields are ignored (with a warning in the log), and odd but
# valid values work. Thousands of stop strings and a megabyte stop string are valid requests.
GOOD: list[tuple[str, str, Any, dict[str, str]]] = [
    ("oai-unknown-field", CMPL, cmpl(unknown_field={"x": 1}), {}),
    ("chat-unknown-field", CHAT, chat(foo="bar"), {}),
    ("v2-unknown-parameter", V2, v2(parameters={"max_tokens": 2, "bogus_option": 1}), {}),
    ("oai-thousands-of-stop-strings", CMPL, cmpl(stop=[f"zz{i}" for i in range(5000)]), {}),
    ("oai-megabyte-stop-string", CMPL, cmpl(stop=["y" * MB]), {}),
    ("v2-megabyte-stop-string", V2, v2(parameters={"max_tokens": 2, "stop": "y" * MB}), {}),
    ("oai-no-model-field", CMPL, {"prompt": "Hi", "max_tokens": 2}, {}),
    ("oai-all-sampling-options", CMPL, cmpl(n=3, best_of=3, logprobs=5, echo=True,
                                            prompt_logprobs=2, presence_penalty=-2,
                                            frequency_penalty=2, repetition_penalty=100,
                                            logit_bias={"1": -100, "2": 100}, seed=1,
                                            include_stop_str_in_output=True,
                                            skip_special_tokens=False), {}),
    ("chat-all-sampling-options", CHAT, chat(n=2, logprobs=True, top_logprobs=20,
                                             max_completion_tokens=2, logit_bias={"1": 5},
                                             presence_penalty=1), {}),
    ("oai-huge-seed", CMPL, cmpl(seed=10**30), {}),
    ("oai-huge-top-k", CMPL, cmpl(top_k=10**12, temperature=1.0), {}),
    ("oai-tiny-temperature", CMPL, cmpl(temperature=1e-300), {}),
    ("oai-huge-temperature", CMPL, cmpl(temperature=1e300), {}),
    ("oai-max-tokens-zero", CMPL, cmpl(max_tokens=0, echo=True, logprobs=1), {}),
    ("oai-json-mode", CMPL, cmpl(response_format={"type": "json_object"}), {}),
    ("v2-beam-width", V2, v2(parameters={"max_tokens": 2, "beam_width": 2}), {}),
    ("oai-beam-search", CMPL, cmpl(use_beam_search=True), {}),
    ("v2-guided-choice", V2, v2(parameters={"max_tokens": 4, "guided_choice": '["a", "b"]'}),
     {}),
    ("chat-tools-auto", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     {}),
]


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


def fuzz_openai_routes(url: str) -> dict[str, int]:
    """Run schemathesis against the server at ``url``; returns {status code: calls}. Raises
    (schemathesis' report) on the first violated check."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    raw = httpx.get(f"{url}/openapi.json", timeout=10).json()
    for op in ("/openai/v1/completions", "/openai/v1/chat/completions"):
        assert "requestBody" in raw["paths"][op]["post"], f"{op} publishes no request schema"
        # n up to 128 is valid, but 128 samples of up to 64 tokens take about a minute on two
        # CPU cores: fuzz with at most FUZZ_MAX_N samples so every call fits the budget.
        props = raw["paths"][op]["post"]["requestBody"]["content"]["application/json"][
            "schema"]["properties"]
        for name in ("n", "best_of"):
            field = props.get(name, {})
            for branch in [field, *field.get("anyOf", [])]:
                if branch.get("type") == "integer":
                    branch["maximum"] = FUZZ_MAX_N
    schema = schemathesis.openapi.from_dict(raw).include(path_regex="^/openai/v1/")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    calls: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/openai/v1/completions",
                                             "/openai/v1/chat/completions"}
    session = requests.Session()
    for operation in operations:
        # GET /models takes nothing that could be made invalid: positive data only.
        modes = ([GenerationMode.POSITIVE] if operation.method.upper() == "GET"
                 else [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
        for mode in modes:
            # Positive cases generate tokens (~0.5 s each on 2 CPU cores); negative ones are
            # refused at once, so they get more examples.
            examples = 25 if mode is GenerationMode.POSITIVE else 50

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case: Any) -> None:
                response = case.call_and_validate(base_url=url, session=session,
                                                  checks=checks, timeout=60)
                calls[response.status_code] += 1

            fuzz()
    return {str(code): n for code, n in sorted(calls.items())}


def test_schemathesis_fuzzing_of_the_openai_routes(server: Server):
    """Generated from /openapi.json (per POST route 25 valid and 50 invalid requests): no 5xx,
    and statuses, content types, JSON bodies and SSE events as the schema documents them.

    In a fresh interpreter: a library loaded earlier in a pytest run may set the CPU's
    flush-to-zero mode, and hypothesis then refuses to generate floats."""
    code = ("import json, sys; from e2e.test_reliability_input import fuzz_openai_routes; "
            "print('CALLS', json.dumps(fuzz_openai_routes(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, server.url], capture_output=True,
                          text=True, timeout=500, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    calls = json.loads(proc.stdout.rsplit("CALLS ", 1)[1])
    record("schemathesis", calls=sum(calls.values()), codes=calls)
    assert not any(int(code) >= 500 for code in calls), calls
    wait_idle(server, timeout=5)
