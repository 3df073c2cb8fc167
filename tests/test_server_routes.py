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
from kserve_paged.request_options import OptionError, resolve_max_tokens
from kserve_paged.v2 import v2_parameters
from tests.helpers.options import make_sampling_params
from tests.helpers.server import (
    NAME,
    V2_BODY,
    FakeEngine,
    build,
    client,
    ready,
    run,
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
