"""The server in process (tests/helpers/server.py): KServe's routes + ours on a fresh FastAPI
app, a deterministic fake engine, so these run in seconds. e2e/ covers the real process and
model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kserve_paged import server as srv
from kserve_paged.sampling import OptionError, make_sampling_params, resolve_max_tokens
from kserve_paged.v2 import v2_parameters
from tests.helpers.server import (
    NAME,
    V2_BODY,
    FakeEngine,
    build,
    client,
    ready,
    run,
    sse,
)

# -- readiness --------------------------------------------------------------------------------

def test_not_ready_until_the_engine_is_loaded_and_warm():
    async def main() -> None:
        gate = asyncio.Event()
        loop = asyncio.get_running_loop()

        def factory() -> FakeEngine:
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
            return FakeEngine()

        app, model = build(factory=factory)
        async with client(app) as c:
            starting = asyncio.create_task(model.start_engine())
            await asyncio.sleep(0.05)
            assert (await c.get(f"/v2/models/{NAME}/ready")).status_code == 503
            assert (await c.get(f"/v1/models/{NAME}")).status_code == 503
            r = await c.post("/openai/v1/completions", json={"model": NAME, "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["message"]
            r = await c.post(f"/v2/models/{NAME}/infer", json=V2_BODY)
            assert r.status_code == 503 and "error" in r.json()
            gate.set()
            await starting
            assert (await c.get(f"/v2/models/{NAME}/ready")).status_code == 200
            assert (await c.get(f"/v1/models/{NAME}")).json() == {"name": NAME, "ready": True}
        model.stop_engine()
    run(main())


def test_load_failure_raises_from_start_engine():
    async def main() -> None:
        def factory() -> FakeEngine:
            raise FileNotFoundError("no config.json")

        _, model = build(factory=factory)
        with pytest.raises(Exception, match="no config.json"):
            await model.start_engine()
        assert not await model.healthy()
    run(main())


# -- v2 ---------------------------------------------------------------------------------------

def test_beam_search_options_reach_the_engine():
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post(f"/v2/models/{NAME}/infer", json={**V2_BODY, "parameters": {
                "max_tokens": 3, "beam_width": 4, "length_penalty": "0.5",
                "early_stopping": "never"}})
            assert r.status_code == 200, r.text
            params = engine.added[-1][2]
            assert (params.use_beam_search, params.beam_width, params.n) == (True, 4, 1)
            assert (params.length_penalty, params.early_stopping) == (0.5, "never")
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "prompt": "a", "max_tokens": 3, "use_beam_search": True,
                "n": 2, "best_of": 3, "early_stopping": True})
            assert r.status_code == 200, r.text
            params = engine.added[-1][2]
            assert (params.use_beam_search, params.beam_width, params.n) == (True, 3, 2)
            assert params.early_stopping is True
            r = await c.post("/openai/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                "use_beam_search": True, "n": 2})
            assert r.status_code == 200, r.text
            assert engine.added[-1][2].beam_width == 2
        model.stop_engine()
    run(main())


def test_v2_infer_json_without_content_type():
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            body = json.dumps({**V2_BODY, "parameters": {
                "max_tokens": 3, "temperature": 0.5, "top_k": 4, "seed": 7, "stop": "zzz",
                "ignore_eos": True, "min_tokens": 1, "stop_token_ids": "5, 6", "top_p": 0.9,
                "min_p": 0.1, "binary_data_output": False}})
            # tritonclient.http sends no Content-Type; the middleware supplies it.
            r = await c.post(f"/v2/models/{NAME}/infer", content=body)
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            assert out["name"] == "text_output" and out["shape"] == [2]
            assert out["data"] == [" one two three"] * 2
            params = engine.added[-1][2]
            assert (params.temperature, params.top_k, params.seed, params.stop) == (
                0.5, 4, 7, ["zzz"])
            assert params.ignore_eos and params.min_tokens == 1 and params.stop_token_ids == [5, 6]
            # curl -d sends form encoding: treated as JSON on infer routes.
            r = await c.post(f"/v2/models/{NAME}/infer", content=json.dumps(V2_BODY),
                             headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code == 200
        model.stop_engine()
    run(main())


def test_v2_infer_binary_tritonclient_encoding():
    import tritonclient.http as httpclient

    async def main() -> None:
        app, model, _ = await ready()
        tensor = httpclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"a b"], dtype=object), binary_data=True)
        out = httpclient.InferRequestedOutput("text_output", binary_data=True)
        body, json_size = httpclient.InferenceServerClient.generate_request_body(
            [tensor], outputs=[out], parameters={"max_tokens": 2})
        async with client(app) as c:
            r = await c.post(f"/v2/models/{NAME}/infer", content=body,
                             headers={"Inference-Header-Content-Length": str(json_size)})
            assert r.status_code == 200, r.text
            result = httpclient.InferenceServerClient.parse_response_body(
                r.content, header_length=int(r.headers["inference-header-content-length"]))
            assert result.as_numpy("text_output").tolist() == [b" one two"]
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("parameters,inputs,message", [
    ({"max_tokens": 100}, None, "maximum context length is 64"),
    ({"temperature": -1}, None, "temperature"),
    ({"beam_width": "wide"}, None, "beam_width"),
    ({"beam_width": 2, "n": 3}, None, "best_of"),
    ({"num_beams": 4}, None, "num_beams"),
    ({}, [{"name": "other", "datatype": "BYTES", "shape": [1], "data": ["x"]}], "other"),
    ({}, [{"name": "text_input", "datatype": "INT32", "shape": [1], "data": [1]}], "BYTES"),
])
def test_v2_bad_requests_are_400(parameters, inputs, message):
    async def main() -> None:
        app, model, engine = await ready()
        body = {"inputs": inputs or V2_BODY["inputs"], "parameters": parameters}
        async with client(app) as c:
            r = await c.post(f"/v2/models/{NAME}/infer", json=body)
            assert r.status_code == 400 and message in r.json()["error"], r.text
            r = await c.post(f"/v2/models/{NAME}/infer", content=b'{"inputs": [')
            assert r.status_code == 400 and r.json()["error"]
        assert engine.added == []
        model.stop_engine()
    run(main())


def test_v2_metadata_lists_the_tensors():
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            meta = (await c.get(f"/v2/models/{NAME}")).json()
        assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
        assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
        model.stop_engine()
    run(main())


def test_grpc_parameters_including_doubles():
    """tritonclient.grpc's double_param (field 4) and uint64_param (field 5) are unknown to
    KServe's InferParameter; the wire bytes are built by hand because tritonclient's and
    KServe's protos cannot be loaded in one process (same package name)."""
    import struct

    from kserve.protocol.grpc import grpc_predict_v2_pb2 as kpb

    def convert(wire: bytes) -> Any:
        return v2_parameters({"p": kpb.InferParameter.FromString(wire)})["p"]

    assert convert(b"\x21" + struct.pack("<d", 0.7)) == 0.7
    assert convert(b"\x28" + bytes([0xAC, 0x02])) == 300
    assert convert(kpb.InferParameter(int64_param=-3).SerializeToString()) == -3
    assert convert(kpb.InferParameter(bool_param=True).SerializeToString()) is True
    assert convert(kpb.InferParameter(string_param="x").SerializeToString()) == "x"
    assert v2_parameters({"max_tokens": 3}) == {"max_tokens": 3}


# -- OpenAI -----------------------------------------------------------------------------------

def test_openai_completions_and_usage():
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "prompt": ["a b", "c"], "max_tokens": 2, "priority": 3,
                "user": "u", "cache_salt": "s1"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "text_completion" and body["model"] == NAME
            assert [ch["text"] for ch in body["choices"]] == [" one two"] * 2
            assert [ch["index"] for ch in body["choices"]] == [0, 1]
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                     "total_tokens": 7, "prompt_tokens_details":
                                     {"cached_tokens": 0}}
            assert {a[3] for a in engine.added} == {3} and {a[4] for a in engine.added} == {"s1"}
            # token-id prompts and the x-cache-salt header
            r = await c.post("/openai/v1/completions", headers={"x-cache-salt": "hdr"},
                             json={"model": NAME, "prompt": [0, 1], "stop": " two"})
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            assert engine.added[-1][1] == [0, 1] and engine.added[-1][4] == "hdr"
            assert engine.added[-1][2].max_tokens == 16  # OpenAI's default for completions
        model.stop_engine()
    run(main())


def test_openai_streaming_completions_and_chat():
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "prompt": ["a", "b"], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = sse(r.text)
            for i in (0, 1):
                texts = [ch["choices"][0]["text"] for ch in chunks
                         if ch["choices"] and ch["choices"][0]["index"] == i]
                assert "".join(texts) == " one two three"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

            r = await c.post("/openai/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 2, "stream": True})
            chunks = sse(r.text)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(ch["choices"][0]["delta"].get("content", "")
                           for ch in chunks) == " one two"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            assert "usage" not in chunks[-1] or chunks[-1]["usage"] is None
        model.stop_engine()
    run(main())


def test_openai_chat_applies_the_template():
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post("/openai/v1/chat/completions", json={
                "model": NAME, "max_tokens": 2, "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"] == {"role": "assistant", "content": " one two"}
            tok = engine.tokenizer
            assert tok.decode(engine.added[-1][1]) == (
                " <system> be brief <user> hi there <assistant>")
            # no max_tokens: the rest of the context window
            await c.post("/openai/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "x"}]})
            assert engine.added[-1][2].max_tokens == 64 - len(engine.added[-1][1])
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("path,extra,param,status", [
    ("completions", {"n": 0}, "n", 400),
    ("completions", {"best_of": 3}, "best_of", 400),
    ("completions", {"logprobs": 21}, "logprobs", 400),
    ("completions", {"suffix": "x"}, "suffix", 400),
    ("completions", {"use_beam_search": True, "stream": True}, "stream", 400),
    ("chat/completions", {"use_beam_search": True, "stream": True}, "stream", 400),
    ("completions", {"presence_penalty": 3}, "presence_penalty", 400),
    ("completions", {"logit_bias": {"1": 200}}, "logit_bias", 400),
    ("completions", {"max_tokens": 64}, "max_tokens", 400),
    ("completions", {"temperature": "hot"}, "temperature", 400),
    ("completions", {"top_p": 0}, "top_p", 400),
    ("completions", {"model": "other"}, "model", 404),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools", 400),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", 400),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages", 400),
])
def test_openai_rejects_what_it_cannot_honour(path, extra, param, status):
    async def main() -> None:
        app, model, engine = await ready()
        body: dict[str, Any] = {"model": NAME}
        body.update({"prompt": "a"} if path == "completions"
                    else {"messages": [{"role": "user", "content": "a"}]})
        body.update(extra)
        async with client(app) as c:
            r = await c.post(f"/openai/v1/{path}", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"]
        assert engine.added == []
        model.stop_engine()
    run(main())


def test_openai_malformed_and_models():
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", content=b"{nope",
                             headers={"content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
            r = await c.post("/openai/v1/completions", json=[1, 2])
            assert r.status_code == 400
            models = (await c.get("/openai/v1/models")).json()
            assert models["object"] == "list"
            assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == 64
        model.stop_engine()
    run(main())


def test_vllm_paths_serve_completions_and_chat():
    """An LLMInferenceService's route rewrites to vLLM's /v1/completions and
    /v1/chat/completions (manifests/llmisvc): the same handlers answer there; /v1/models stays
    KServe's v1-protocol model list."""
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            body = {"model": NAME, "prompt": "a b", "max_tokens": 2, "temperature": 0}
            ours = (await c.post("/openai/v1/completions", json=body)).json()
            alias = (await c.post("/v1/completions", json=body)).json()
            assert alias["choices"] == ours["choices"] and alias["usage"] == ours["usage"]
            chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            r = await c.post("/v1/completions", json={"model": "other", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["message"]  # OpenAI's shape
            assert (await c.get("/v1/models")).json() == {"models": [NAME]}
        model.stop_engine()
    run(main())


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_route_is_ours_and_updates_per_step():
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            await c.post("/openai/v1/completions", json={"model": NAME, "prompt": "a b",
                                                         "max_tokens": 3})
            await asyncio.sleep(0.05)
            r = await c.get("/metrics", headers={
                "accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
        assert r.headers["content-type"].startswith("text/plain")
        # This test's metrics live in a private registry; the route serves the default one, so
        # check the observer's effect on the model's registry directly.
        from prometheus_client import generate_latest

        text = generate_latest(model.test_registry).decode()
        assert 'vllm:generation_tokens_total{model_name="m"} 3.0' in text
        assert 'vllm:prompt_tokens_total{model_name="m"} 2.0' in text
        assert 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="32"}' in text
        assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
        assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
        assert 'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0' in text
        assert 'vllm:request_queue_time_seconds_count{model_name="m"} 1.0' in text
        model.stop_engine()
    run(main())


# -- helpers ----------------------------------------------------------------------------------

def test_model_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(srv, "DEFAULT_MODEL_DIR", str(tmp_path / "absent"))
    assert srv.resolve_model_dir(str(tmp_path / "absent"), explicit=False) is None
    with pytest.raises(FileNotFoundError):
        srv.resolve_model_dir(str(tmp_path / "absent"), explicit=True)
    with pytest.raises(FileNotFoundError):
        srv.resolve_model_dir(str(tmp_path / "other"), explicit=False)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert srv.resolve_model_dir(str(tmp_path / "hf"), explicit=True) == str(tmp_path / "hf")
    (tmp_path / "mnt" / "sub").mkdir(parents=True)
    (tmp_path / "mnt" / "sub" / "config.json").write_text("{}")
    assert srv.resolve_model_dir(str(tmp_path / "mnt"), True) == str(tmp_path / "mnt" / "sub")
    assert srv.model_dir_given(["--model_dir=/x"]) and srv.model_dir_given(["--model_dir", "/x"])
    assert not srv.model_dir_given(["--model_name", "m"])


def test_context_window_checks():
    assert resolve_max_tokens(10, None, 64) == 54
    assert resolve_max_tokens(10, 54, 64) == 54
    with pytest.raises(OptionError, match="maximum context length is 64"):
        resolve_max_tokens(10, 55, 64)
    with pytest.raises(OptionError, match="no room"):
        resolve_max_tokens(64, None, 64)
    # a default budget shrinks to fit, an explicit one does not
    assert make_sampling_params({}, prompt_len=60, max_model_len=64,
                                default_max_tokens=16).max_tokens == 4
    with pytest.raises(OptionError) as err:
        make_sampling_params({"top_k": "x"}, prompt_len=1, max_model_len=64,
                             default_max_tokens=16)
    assert err.value.param == "top_k"
    p = make_sampling_params({"temperature": "0.5", "stop": "x", "seed": 3.0}, prompt_len=1,
                             max_model_len=64, default_max_tokens=None)
    assert (p.temperature, p.stop, p.seed, p.max_tokens) == (0.5, ["x"], 3, 63)
