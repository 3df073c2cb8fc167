"""LoRA adapters through the server in process: a real engine on a tiny random Llama, adapters
routed by the OpenAI `model` field, listed with their parent, loaded and unloaded at run time."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from kserve.model_repository import ModelRepository
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import RESTServer
from prometheus_client import CollectorRegistry

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged import server as srv  # noqa: E402
from kserve_paged.metrics import EngineMetrics  # noqa: E402
from kserve_paged.model import PagedLLMModel  # noqa: E402
from kserve_paged_engine.config.engine import EngineConfig  # noqa: E402
from kserve_paged_engine.frontend.async_llm import AsyncLLM  # noqa: E402
from tests.helpers.lora import make_adapter, peft_greedy, tiny_base  # noqa: E402

PROMPT = list(range(100, 120))
NEW = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("srvlora")
    tiny_base(root / "base")
    make_adapter(root / "base", root / "a1", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    make_adapter(root / "base", root / "a2", seed=2, r=8, lora_alpha=8,
                 target_modules=["o_proj", "up_proj"])
    return {"root": root, "base": root / "base", "a1": root / "a1", "a2": root / "a2"}


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str | None, list[int]]:
    return {name: peft_greedy(dirs["base"], dirs[name] if name else None, [PROMPT], NEW)[0]
            for name in (None, "a1", "a2")}


def _build(dirs, runtime_updates: bool) -> tuple[FastAPI, PagedLLMModel]:
    config = EngineConfig(model=str(dirs["base"]), enable_lora=True, max_loras=2,
                          num_kv_blocks=128, max_model_len=128)
    model = PagedLLMModel("base", config, llm=AsyncLLM(config),
                          metrics=EngineMetrics("base", registry=CollectorRegistry()),
                          lora_modules=[("a1", str(dirs["a1"]))])
    model.load()
    registry = ModelRepository()
    registry.update(model)
    model.repository = registry
    app = FastAPI()
    srv.install(app, model, lora_runtime_updates=runtime_updates, lora_roots=[str(dirs["root"])])
    rest = RESTServer("kserve.model_server:app", DataPlane(model_registry=registry),
                      ModelRepositoryExtension(model_registry=registry), 0)
    rest._register_endpoints(app)
    rest._add_exception_handlers(app)
    return app, model


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=60)


async def _complete(c: httpx.AsyncClient, model: str) -> httpx.Response:
    return await c.post("/openai/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})


def test_adapters_routed_listed_loaded_and_unloaded(dirs, reference):
    async def main() -> None:
        app, model = _build(dirs, runtime_updates=True)
        await model.start_engine()
        tok = model.info.tokenizer
        want = {k: tok.decode(v) for k, v in reference.items()}
        assert len(set(want.values())) == 3  # each adapter changes the continuation
        async with _client(app) as c:
            listed = (await c.get("/openai/v1/models")).json()["data"]
            assert [(m["id"], m.get("parent")) for m in listed] == [("base", None),
                                                                    ("a1", "base")]
            r = await c.post("/openai/v1/load_lora_adapter",
                             json={"lora_name": "a2", "lora_path": str(dirs["a2"])})
            assert r.status_code == 200, r.text
            # Base and both adapters at once: one engine, mixed steps, each its own output.
            outs = await asyncio.gather(*(_complete(c, m) for m in ("a1", "base", "a2", "a1")))
            texts = [o.json()["choices"][0]["text"] for o in outs]
            assert texts == [want["a1"], want[None], want["a2"], want["a1"]]
            assert outs[0].json()["model"] == "a1"
            r = await _complete(c, "nope")
            assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
            r = await c.post("/openai/v1/load_lora_adapter",
                             json={"lora_name": "a2", "lora_path": str(dirs["a2"])})
            assert r.status_code == 400 and "already" in r.json()["error"]["message"]
            r = await c.post("/openai/v1/load_lora_adapter",
                             json={"lora_name": "bad", "lora_path": str(dirs["base"])})
            assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
            r = await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 200
            assert (await _complete(c, "a2")).status_code == 404
            r = await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 404
            assert [m["id"] for m in (await c.get("/openai/v1/models")).json()["data"]] == [
                "base", "a1"]
        model.stop_engine()
    asyncio.run(main())


def _v2_body(text: str) -> dict:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                        "data": [text]}],
            "parameters": {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def test_v2_routes_serve_each_adapter_under_its_name(dirs):
    async def main() -> None:
        app, model = _build(dirs, runtime_updates=True)
        await model.start_engine()
        text = "Once upon a time"
        async with _client(app) as c:
            assert (await c.get("/v2/models/a1/ready")).status_code == 200
            meta = (await c.get("/v2/models/a1")).json()
            assert meta["name"] == "a1" and meta["inputs"][0]["name"] == "text_input"
            assert (await c.get("/v2/models/a2/ready")).status_code != 200
            outs = {}
            for name in ("base", "a1"):
                r = await c.post(f"/v2/models/{name}/infer", json=_v2_body(text))
                assert r.status_code == 200, r.text
                outs[name] = r.json()["outputs"][0]["data"][0]
            r = await c.post("/openai/v1/completions", json={
                "model": "a1", "prompt": text, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True})
            assert outs["a1"] == r.json()["choices"][0]["text"] != outs["base"]
            r = await c.post("/openai/v1/load_lora_adapter",
                             json={"lora_name": "a2", "lora_path": str(dirs["a2"])})
            assert (await c.get("/v2/models/a2/ready")).status_code == 200
            await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert (await c.post("/v2/models/a2/infer", json=_v2_body(text))).status_code == 404
        model.stop_engine()
    asyncio.run(main())


def test_runtime_updates_refused_unless_enabled(dirs):
    async def main() -> None:
        app, model = _build(dirs, runtime_updates=False)
        await model.start_engine()
        async with _client(app) as c:
            r = await c.post("/openai/v1/load_lora_adapter",
                             json={"lora_name": "a2", "lora_path": str(dirs["a2"])})
            assert r.status_code == 404
            assert "--enable_lora_runtime_updates" in r.json()["error"]["message"]
            r = await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "a1"})
            assert r.status_code == 404
            assert (await _complete(c, "a1")).status_code == 200  # start-up adapters serve
        model.stop_engine()
    asyncio.run(main())


def test_lora_flags_parse_and_enable_lora():
    from kserve_paged.args import engine_kwargs, parse_args

    args = parse_args(["--lora_modules", "a=/x", "b=/y", "--max_loras", "2",
                       "--max_lora_rank", "32"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")]
    kw = engine_kwargs(args)
    assert kw["enable_lora"] and kw["max_loras"] == 2 and kw["max_lora_rank"] == 32
    assert not engine_kwargs(parse_args([]))["enable_lora"]
    with pytest.raises(SystemExit):
        parse_args(["--lora_modules", "noequals"])
    with pytest.raises(SystemExit):
        parse_args(["--max_loras", "3", "--max_cpu_loras", "2"])
