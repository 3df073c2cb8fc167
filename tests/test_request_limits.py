"""Request limits (kserve_paged_engine.limits): one set of numbers for SamplingParams, the server's parsers and
the published OpenAPI schema; oversized bodies and prompts refused before they are parsed or
tokenized, and tokenization off the event loop (issue 16)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from kserve_paged import args as server_args
from kserve_paged.openai.openapi import operation_schema
from kserve_paged.openai.schemas import ChatBody, ChatCompletionOut, CompletionBody, CompletionOut
from kserve_paged.request_options import OptionError
from kserve_paged_engine import limits as L
from kserve_paged_engine.sampling_params import SamplingParams
from tests.helpers.options import make_sampling_params
from tests.helpers.server import NAME, V2_BODY, FakeEngine, FakeTokenizer, client, ready, run

# -- the numbers, and who reads them -----------------------------------------------------------


@pytest.mark.parametrize("field, ok, bad", [
    ("n", [L.MIN_N, L.MAX_N], [L.MIN_N - 1, L.MAX_N + 1]),
    ("logprobs", [L.MIN_LOGPROBS, L.MAX_LOGPROBS], [L.MIN_LOGPROBS - 1, L.MAX_LOGPROBS + 1]),
    ("prompt_logprobs", [L.MAX_LOGPROBS], [L.MAX_LOGPROBS + 1]),
    ("presence_penalty", list(L.PENALTY_RANGE), [L.PENALTY_RANGE[1] + 0.1]),
    ("frequency_penalty", list(L.PENALTY_RANGE), [L.PENALTY_RANGE[0] - 0.1]),
    ("repetition_penalty", [L.REPETITION_PENALTY_RANGE[1]], [L.REPETITION_PENALTY_RANGE[0]]),
    ("top_p", [L.TOP_P_RANGE[1]], [L.TOP_P_RANGE[0]]),
    ("min_p", list(L.MIN_P_RANGE), [L.MIN_P_RANGE[1] + 0.5]),
    ("temperature", [L.MIN_TEMPERATURE], [L.MIN_TEMPERATURE - 1]),
    ("top_k", [L.MIN_TOP_K], [L.MIN_TOP_K - 1]),
    ("min_tokens", [L.MIN_MIN_TOKENS], [L.MIN_MIN_TOKENS - 1]),
])
def test_sampling_params_validate_against_the_limits(field: str, ok: list[Any], bad: list[Any]):
    for value in ok:
        SamplingParams(**{field: value})
    for value in bad:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_logit_bias_range_is_the_same_for_the_parser_and_sampling_params():
    low, high = L.LOGIT_BIAS_RANGE
    params = make_sampling_params({"logit_bias": {"1": low, "2": high}}, prompt_len=1,
                                  max_model_len=64, default_max_tokens=4, vocab_size=10)
    assert params.logit_bias == {1: low, 2: high}
    for value in (low - 1, high + 1):
        with pytest.raises(OptionError, match="logit_bias"):
            make_sampling_params({"logit_bias": {"1": value}}, prompt_len=1, max_model_len=64,
                                 default_max_tokens=4, vocab_size=10)
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias={1: value})
    with pytest.raises(OptionError, match="max_tokens"):
        make_sampling_params({"max_tokens": L.MIN_MAX_TOKENS - 1}, prompt_len=1,
                             max_model_len=64, default_max_tokens=4)


def _bounds(props: dict[str, Any], name: str) -> dict[str, Any]:
    field = props[name]
    branches = [b for b in field.get("anyOf", [field]) if b.get("type") != "null"]
    return {k: v for b in branches for k, v in b.items()
            if k in ("minimum", "maximum", "exclusiveMinimum")}


def test_the_published_schema_takes_its_ranges_from_the_limits():
    for body, result in ((CompletionBody, CompletionOut), (ChatBody, ChatCompletionOut)):
        props = operation_schema(body, result, [NAME])["requestBody"]["content"][
            "application/json"]["schema"]["properties"]

        def bounds(name: str, props: dict[str, Any] = props) -> dict[str, Any]:
            return _bounds(props, name)

        assert bounds("n") == {"minimum": L.MIN_N, "maximum": L.MAX_N}
        assert bounds("prompt_logprobs") == {"minimum": L.MIN_LOGPROBS,
                                             "maximum": L.MAX_LOGPROBS}
        assert bounds("presence_penalty") == {"minimum": L.PENALTY_RANGE[0],
                                              "maximum": L.PENALTY_RANGE[1]}
        assert bounds("repetition_penalty") == {
            "exclusiveMinimum": L.REPETITION_PENALTY_RANGE[0],
            "maximum": L.REPETITION_PENALTY_RANGE[1]}
        assert bounds("max_tokens") == {"minimum": L.MIN_MAX_TOKENS}
        assert bounds("min_tokens") == {"minimum": L.MIN_MIN_TOKENS}
        bias = props["logit_bias"]["anyOf"][0]["additionalProperties"]
        assert (bias["minimum"], bias["maximum"]) == L.LOGIT_BIAS_RANGE
        assert "413" in operation_schema(body, result, [NAME])["responses"]
    props = operation_schema(CompletionBody, CompletionOut, [])["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    assert props["logprobs"]["anyOf"][0]["maximum"] == L.MAX_LOGPROBS


def test_one_prompt_check_and_one_min_tokens_rule():
    L.check_prompt_ids([0, 9], vocab_size=10)
    L.check_prompt_ids([10**6], vocab_size=None)
    for ids in ([], [10], [-1], [True], [1.5]):
        with pytest.raises(ValueError, match="empty" if not ids else "out of range"):
            L.check_prompt_ids(ids, vocab_size=10)  # type: ignore[arg-type]
    assert not L.past_min_tokens(2, 3) and L.past_min_tokens(3, 3) and L.past_min_tokens(0, 0)


def test_prompt_character_limit_derives_from_the_context_window_and_flags():
    assert L.max_prompt_chars(64) == 64 * L.PROMPT_CHARS_PER_TOKEN
    assert "4097 characters" in L.prompt_too_long(4097, 4096)
    args = server_args.parse_args([])
    assert args.max_prompt_chars is None and args.max_request_bytes == L.DEFAULT_MAX_REQUEST_BYTES
    args = server_args.parse_args(["--max_prompt_chars", "100", "--max_request_bytes=2048"])
    assert (args.max_prompt_chars, args.max_request_bytes) == (100, 2048)
    with pytest.raises(SystemExit):
        server_args.parse_args(["--max_request_bytes", "0"])


@pytest.mark.slow  # a child interpreter importing the openai package
def test_the_openai_client_package_is_not_shadowed_by_ours():
    code = ("import kserve_paged.openai as ours, openai; from openai import OpenAI; "
            "assert ours is not openai and hasattr(openai, 'OpenAI'), openai; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


# -- the server: refused before parsing or tokenizing, tokenized off the loop ------------------

class CountingTokenizer(FakeTokenizer):
    """Records each encode call's text length and thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((len(text), threading.get_ident()))
        return super().encode(text, add_special_tokens)


def counting_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer = CountingTokenizer()
    return engine


LIMIT = 100  # --max_prompt_chars in these tests
LONG = "w " * LIMIT  # 2 * LIMIT characters


@pytest.mark.parametrize("path, body, param", [
    ("/openai/v1/completions", {"prompt": LONG}, "prompt"),
    ("/openai/v1/completions", {"prompt": ["a", LONG]}, "prompt"),
    ("/openai/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]},
     "messages"),
    ("/openai/v1/chat/completions", {"messages": [{"role": "system", "content": LONG[:60]},
                                                  {"role": "user", "content": LONG[:60]}]},
     "messages"),
])
def test_openai_prompt_over_the_character_limit_is_400_before_tokenizing(path, body, param):
    async def main() -> None:
        app, model, engine = await ready(counting_engine(), max_prompt_chars=LIMIT)
        async with client(app) as c:
            r = await c.post(path, json={"model": NAME, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and f"more than this server tokenizes ({LIMIT})" in (
            err["message"])
        assert engine.tokenizer.calls == [] and engine.added == []
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("path, body", [
    (f"/v2/models/{NAME}/infer", {**V2_BODY, "inputs": [{**V2_BODY["inputs"][0], "shape": [2],
                                                          "data": ["a", LONG]}]}),
    (f"/v1/models/{NAME}:predict", {"instances": [LONG]}),
])
def test_v1_v2_prompt_over_the_character_limit_is_400_before_tokenizing(path, body):
    async def main() -> None:
        app, model, engine = await ready(counting_engine(), max_prompt_chars=LIMIT)
        async with client(app) as c:
            r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "more than this server tokenizes" in r.json()["error"]
        assert all(n <= LIMIT for n, _ in engine.tokenizer.calls) and engine.added == []
        model.stop_engine()
    run(main())


def test_prompts_within_the_limit_are_tokenized_off_the_event_loop():
    async def main() -> None:
        app, model, engine = await ready(counting_engine(), max_prompt_chars=LIMIT)
        loop_thread = threading.get_ident()
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "prompt": "w " * (LIMIT // 2), "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/openai/v1/chat/completions", json={
                "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            r = await c.post(f"/v2/models/{NAME}/infer", json=V2_BODY)
            assert r.status_code == 200, r.text
        calls = engine.tokenizer.calls
        assert len(calls) == 4 and all(thread != loop_thread for _, thread in calls)
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("path, openai_shape", [
    ("/openai/v1/completions", True),
    (f"/v2/models/{NAME}/infer", False),
    (f"/v1/models/{NAME}:predict", False),
])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_max_request_bytes_is_413(path, openai_shape, chunked):
    async def main() -> None:
        app, model, engine = await ready(counting_engine(), max_request_bytes=1000)
        payload = b'{"prompt": "' + b"x" * 2000 + b'"}'

        async def pieces():  # no Content-Length: the middleware counts what arrives
            for i in range(0, len(payload), 256):
                yield payload[i:i + 256]

        async with client(app) as c:
            r = await c.post(path, content=pieces() if chunked else payload,
                             headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            message = err["message"] if openai_shape else err
            assert "more than this server accepts (1000" in message
            # A body within the limit still gets through, chunked or not.
            small = V2_BODY if "/v2/" in path else (
                {"instances": ["a"]} if ":predict" in path
                else {"model": NAME, "prompt": "a", "max_tokens": 2})
            raw = json.dumps(small).encode()

            async def small_pieces():
                yield raw[:10]
                yield raw[10:]

            r = await c.post(path, content=small_pieces() if chunked else raw,
                             headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
        assert engine.tokenizer.calls != []
        model.stop_engine()
    run(main())
