"""The server in process: KServe's routes + ours on a fresh FastAPI app, a fake engine.

The app is assembled like ModelServer does it (RESTServer's endpoint registration and exception
handlers) plus kserve_paged.server.install; the engine is a deterministic fake so these run in
seconds. e2e/ covers the real process and model.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from kserve.model_repository import ModelRepository
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import RESTServer
from prometheus_client import CollectorRegistry

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.model_info import ModelInfo
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from kserve_paged import server as srv
from kserve_paged.metrics import EngineMetrics
from kserve_paged.model import PagedLLMModel
from kserve_paged.sampling import OptionError, make_sampling_params, resolve_max_tokens
from kserve_paged.v2 import v2_parameters

NAME = "m"
WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]


class FakeTokenizer:
    """Whitespace words; ids index a growing vocabulary. Enough for prompts and chat."""

    chat_template = "chatml"

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []
        for w in WORDS:
            self._id(w)

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.words)
            self.words.append(word)
        return self.vocab[word]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._id(" " + w) for w in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(self.words[i] for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, **_: Any) -> str:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Generates WORDS in order, one per step; ``stop`` strings end a request."""

    def __init__(self, max_model_len: int = 64) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.config = EngineConfig(block_size=16, num_kv_blocks=32)
        self.num_kv_blocks = 32
        self.model_path = "/fake/model"
        self.reqs: dict[str, dict[str, Any]] = {}
        self.added: list[tuple[str, list[int], SamplingParams, int, str | None]] = []
        self.gen = 0
        self.prompt = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        assert isinstance(prompt, list)
        self.added.append((request_id, prompt, params, priority, cache_salt))
        self.reqs[request_id] = {"prompt": prompt, "out": [], "params": params,
                                 "m": RequestMetrics(time.monotonic())}

    def step(self) -> list[RequestOutput]:
        outs = []
        now = time.monotonic()
        for rid, r in list(self.reqs.items()):
            m: RequestMetrics = r["m"]
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                self.prompt += len(r["prompt"])
            tok = len(r["out"]) % len(WORDS)
            r["out"].append(tok)
            self.gen += 1
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            text = self.tokenizer.decode(r["out"])
            p: SamplingParams = r["params"]
            reason = None
            if any(s in text for s in p.stop):
                reason = "stop"
            elif len(r["out"]) >= p.max_tokens:
                reason = "length"
            if reason:
                m.finished_time = now
                del self.reqs[rid]
            outs.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                0, text, list(r["out"]), reason, delta_text=WORDS[tok], delta_token_ids=[tok])],
                reason is not None, 0, m))
        return outs

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def model_info(self) -> ModelInfo:
        return ModelInfo(model_path=self.model_path, tokenizer=self.tokenizer,
                         max_model_len=self.max_model_len, vocab_size=None, block_size=16,
                         num_kv_blocks=self.num_kv_blocks, has_chat_template=True)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_usage": 0.0,
                "prompt_tokens": self.prompt, "generation_tokens": self.gen,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}


def build(engine: Any = None, factory: Any = None, *, max_prompt_chars: int | None = None,
          **install: Any) -> tuple[FastAPI, PagedLLMModel]:
    llm = AsyncLLM(engine=engine, engine_factory=factory)
    metrics_registry = CollectorRegistry()
    model = PagedLLMModel(NAME, EngineConfig(), llm=llm,
                          metrics=EngineMetrics(NAME, registry=metrics_registry),
                          max_prompt_chars=max_prompt_chars)
    model.test_registry = metrics_registry  # type: ignore[attr-defined]
    model.load()
    registry = ModelRepository()
    registry.update(model)
    app = FastAPI()
    srv.install(app, model, **install)
    rest = RESTServer("kserve.model_server:app", DataPlane(model_registry=registry),
                      ModelRepositoryExtension(model_registry=registry), 0)
    rest._register_endpoints(app)
    rest._add_exception_handlers(app)
    return app, model


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=20)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def sse(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


V2_BODY = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2],
                       "data": ["a b", "c"]}], "parameters": {"max_tokens": 3}}


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


async def ready(engine: FakeEngine | None = None, **build_options: Any
                ) -> tuple[FastAPI, PagedLLMModel, FakeEngine]:
    engine = engine or FakeEngine()
    app, model = build(engine=engine, **build_options)
    await model.start_engine()
    return app, model, engine


# -- v2 ---------------------------------------------------------------------------------------

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
    ({"beam_width": 4}, None, "beam_width"),
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
    ("completions", {"use_beam_search": True}, "use_beam_search", 400),
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
