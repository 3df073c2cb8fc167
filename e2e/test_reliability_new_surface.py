"""Issue 37 parts 1-3 against one real server: hostile adapter loads, hostile grammars and
tools, a bounded waiting queue and deadlines. Each refusal is a 4xx with a message, never a
5xx or a hang (every call has a client timeout); requests sent alongside are served; the
engine is idle afterwards (no request, no KV block held)."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.e2e_server import MODEL, Server, record, running_server, scrape, wait_idle
from tests.helpers.hostile_requests import SLOW_REGEX

CMPL = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
LOAD = "/openai/v1/load_lora_adapter"
TIMEOUT = httpx.Timeout(300.0)  # a shared 2-core machine with LoRA on: slow steps


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from tests.helpers.lora import make_adapter

    base = Path(ensure_default_model(progress=lambda _: None))
    top = tmp_path_factory.mktemp("issue37")
    (top / "roots").mkdir()
    make_adapter(base, top / "roots" / "good", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    shutil.copytree(top / "roots" / "good", top / "outside")
    return top


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    args = ["--enable_lora_runtime_updates", "--lora_roots", str(root / "roots"),
            "--max_lora_rank", "8", "--max_waiting_requests", "4",
            "--max_grammar_compile_s", "3", "--max_num_seqs", "2"]
    with running_server(args, engine_opts={"max_model_len": 256, "num_kv_blocks": 64}) as srv:
        yield srv


def _bad_adapters(root: Path) -> dict[str, str]:
    """lora_path -> what the 400 must say."""
    roots, good = root / "roots", root / "roots" / "good"
    pkl = roots / "pickle-only"
    pkl.mkdir()
    shutil.copy(good / "adapter_config.json", pkl)
    (pkl / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))
    huge = roots / "huge"
    shutil.copytree(good, huge)
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate(16 << 30)
    cut = roots / "truncated"
    shutil.copytree(good, cut)
    w = cut / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: len(w.read_bytes()) // 2])
    (roots / "link-out").symlink_to(root / "outside")
    return {str(root / "outside"): "outside the adapter roots",
            f"{roots}/../outside": "outside the adapter roots",
            str(roots / "link-out"): "outside the adapter roots",
            "/etc": "outside the adapter roots", "relative": "absolute",
            str(pkl): "never", str(huge): "more than any adapter",
            str(cut): "outside the file", str(roots / "missing"): "not a folder"}


def test_hostile_adapter_loads_are_400s_and_change_nothing(server: Server, root: Path):
    bad = _bad_adapters(root)
    codes: Counter[int] = Counter()
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        for i, (path, why) in enumerate(bad.items()):
            r = c.post(LOAD, json={"lora_name": f"bad{i}", "lora_path": path})
            codes[r.status_code] += 1
            assert r.status_code == 400 and why in r.json()["error"]["message"], (path, r.text)
        r = c.post(LOAD, json={"lora_name": "good", "lora_path": str(root / "roots" / "good")})
        assert r.status_code == 200, r.text
        names = [m["id"] for m in c.get("/openai/v1/models").json()["data"]]
        assert names == [MODEL, "good"]
        r = c.post(CMPL, json={"model": "good", "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
        assert c.get(f"/v2/models/{MODEL}/ready").status_code == 200
    wait_idle(server, timeout=10)
    record("issue37_adapters", sent=len(bad) + 1, codes=dict(codes), good_loaded=True)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


TOOLS_10K = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(10_000)]
HOSTILE: dict[str, tuple[str, dict[str, Any]]] = {
    "schema-300-deep": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "d", "schema": _deep(300)}}}),
    "enum-100k": (CMPL, {"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}),
    "choice-100k": (CMPL, {"guided_choice": [f"c{i}" for i in range(100_000)]}),
    "regex-megabyte": (CMPL, {"guided_regex": "a" * (1 << 20)}),
    "regex-slow-to-compile": (CMPL, {"guided_regex": SLOW_REGEX}),
    "grammar-matches-nothing": (CMPL, {"structured_outputs": {"grammar": "root ::= root"}}),
    "tools-10000": (CHAT, {"tools": TOOLS_10K, "tool_choice": "required"}),
    "tool-schema-300-deep": (CHAT, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": _deep(300)}}], "tool_choice": "required"}),
    "prompt-token-out-of-range": (CMPL, {"prompt": [10**9]}),
    "logit-bias-key-out-of-range": (CMPL, {"logit_bias": {"49152": 1}}),
    "logit-bias-key-negative": (CMPL, {"logit_bias": {"-1": 1}}),
    "stop-token-out-of-range": (CMPL, {"stop_token_ids": [10**12]}),
    "n-129": (CMPL, {"n": 129}),
    "beam-width-129": (CMPL, {"use_beam_search": True, "best_of": 129, "n": 1}),
    "timeout-negative": (CMPL, {"timeout": -1}),
}


def _body(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8, **extra}
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 8, **extra}


def test_hostile_grammars_and_tools_fail_only_themselves(server: Server):
    async def main() -> dict[str, tuple[int, float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            async def one(name: str) -> tuple[int, float]:
                path, extra = HOSTILE[name]
                start = time.monotonic()
                r = await c.post(path, json=_body(path, extra))
                assert r.json()["error"]["message"], r.text
                return r.status_code, time.monotonic() - start

            plain = c.post(CMPL, json=_body(CMPL, {"max_tokens": 16, "temperature": 0}))
            results = await asyncio.gather(plain, *(one(n) for n in HOSTILE))
            assert results[0].status_code == 200  # served alongside all of them
            return dict(zip(HOSTILE, results[1:], strict=True))

    results = asyncio.run(main())
    assert {n: code for n, (code, _) in results.items() if code != 400} == {}
    slowest = max(results.items(), key=lambda kv: kv[1][1])
    assert results["regex-slow-to-compile"][1] < 60
    wait_idle(server, timeout=10)
    record("issue37_grammars", sent=len(HOSTILE) + 1, refused_400=len(results),
           slowest=[slowest[0], round(slowest[1][1], 2)],
           slow_regex_s=round(results["regex-slow-to-compile"][1], 2),
           took_s={n: round(t, 2) for n, (_, t) in results.items()})


def test_a_full_queue_is_429_and_deadlines_are_408_leaving_nothing_behind(server: Server):
    """Long because it checks the bound and the four kinds of deadline (the OpenAI body's, the
    header on a stream and on v2, v2's ``parameters.timeout``) on one server, then that the
    metrics counted each refusal and the engine holds nothing."""
    before = scrape(server)

    async def main() -> tuple[Counter[int], list[str], tuple[httpx.Response, float], str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            burst = [c.post(CMPL, json={"model": MODEL, "prompt": f"Count {i}:",
                                        "max_tokens": 12, "ignore_eos": True})
                     for i in range(12)]
            answers = await asyncio.gather(*burst)
            codes = Counter(r.status_code for r in answers)
            retry = [r.headers.get("retry-after", "") for r in answers if r.status_code == 429]
            start = time.monotonic()
            timed = await c.post(CMPL, json={"model": MODEL, "prompt": "Tell a long story",
                                             "max_tokens": 200, "ignore_eos": True,
                                             "timeout": 0.5})
            timed_s = round(time.monotonic() - start, 2)
            stream = await c.post(CMPL, json={"model": MODEL, "prompt": "Tell a story",
                                              "max_tokens": 200, "ignore_eos": True,
                                              "stream": True},
                                  headers={"x-request-timeout": "1"})
            return codes, retry, (timed, timed_s), stream.text

    codes, retry, (timed, timed_s), stream = asyncio.run(main())
    assert codes[429] >= 1 and codes[200] >= 4 and set(codes) <= {200, 429}, codes
    assert set(retry) == {"1"}
    assert timed.status_code == 408 and "deadline" in timed.json()["error"]["message"]
    assert "deadline" in stream and stream.rstrip().endswith("data: [DONE]")
    v2_took = {}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        for how, headers, parameters in (
                ("header", {"x-request-timeout": "0.3"}, {}),
                ("parameter", {}, {"timeout": 300_000}),  # Triton's unit: microseconds
                ("malformed-parameter", {}, {"timeout": 0.3})):
            start = time.monotonic()
            r = c.post(f"/v2/models/{MODEL}/infer", headers=headers, json={
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                            "data": ["Tell a long story"]}],
                "parameters": {"max_tokens": 200, "ignore_eos": True, **parameters}})
            v2_took[how] = round(time.monotonic() - start, 2)
            if how == "malformed-parameter":
                assert r.status_code == 400 and "microseconds" in r.json()["error"], r.text
            else:
                assert r.status_code == 408 and "deadline" in r.json()["error"], r.text
    v2_took["tritonclient"] = _tritonclient_timeout(server)
    took, after = wait_idle(server, timeout=10)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    rejected = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_rejected_total{"))
    timed_out = (after["vllm:num_requests_timed_out_total"]
                 - before.get("vllm:num_requests_timed_out_total", 0))
    assert rejected == codes[429] and timed_out == 5
    record("issue37_admission", burst=12, codes={str(k): v for k, v in codes.items()},
           rejected_metric=rejected, timed_out_metric=timed_out, idle_after_s=round(took, 2),
           openai_timeout_s=timed_s, v2_s=v2_took, pid=os.getpid())


def _tritonclient_timeout(server: Server) -> float:
    """tritonclient's own ``infer(timeout=...)`` (microseconds, sent as ``parameters.timeout``)
    is the request's deadline: 408 after 0.3 s. Returns how long it took."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(server.http_host, network_timeout=300)
    tensor = httpclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"Tell a long story"], dtype=object))
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as exc:
        client.infer(MODEL, [tensor], timeout=300_000,
                     parameters={"max_tokens": 200, "ignore_eos": True})
    assert exc.value.status() == "408" and "deadline" in exc.value.message(), exc.value
    return round(time.monotonic() - start, 2)
