"""Start-up adapters of one folder under several names (KServe's LLMInferenceService lists each
as NAME and publishers/NS/models/NAME): one engine adapter, every name served, listed and
traced as itself; unloading a name keeps the adapter until its last name goes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kserve_paged import server as srv
from kserve_paged.metrics import EngineMetrics
from kserve_paged.model import PagedLLMModel
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.async_llm import AsyncLLM
from tests.helpers.lora import make_adapter, peft_greedy, tiny_base

pytestmark = pytest.mark.slow  # builds a tiny model and two adapters, loads them

PROMPT = list(range(100, 116))
NEW = 6
ALIAS = "publishers/ns/models/sql"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-alias")
    tiny_base(root / "base")
    make_adapter(root / "base", root / "sql", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    make_adapter(root / "base", root / "chat", seed=2, r=4, lora_alpha=8,
                 target_modules=["o_proj", "up_proj"])
    return {"base": root / "base", "sql": root / "sql", "chat": root / "chat"}


def test_names_of_one_folder_share_one_engine_adapter(dirs):
    want = {name: peft_greedy(dirs["base"], dirs[name], [PROMPT], NEW)[0]
            for name in ("sql", "chat")}
    config = EngineConfig(model=str(dirs["base"]), enable_lora=True, max_loras=2,
                          num_kv_blocks=64, max_model_len=128)
    model = PagedLLMModel("base", config, llm=AsyncLLM(config),
                          metrics=EngineMetrics("base", registry=CollectorRegistry()),
                          lora_modules=[("sql", str(dirs["sql"])), (ALIAS, str(dirs["sql"])),
                                        ("chat", str(dirs["chat"]))])
    model.load()
    app = FastAPI()
    srv.install(app, model, lora_runtime_updates=True)

    async def main() -> None:
        await model.start_engine()
        assert model.loras["sql"] is model.loras[ALIAS]
        engine_ids = await model.llm.call_engine(lambda engine: engine.list_loras())
        assert sorted(engine_ids) == sorted({lo.lora_int_id for lo in model.loras.values()})
        assert len(engine_ids) == 2
        tok = model.info.tokenizer
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            listed = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m.get("parent")) for m in listed] == [
                ("base", None), ("sql", "base"), (ALIAS, "base"), ("chat", "base")]

            async def text(name: str) -> httpx.Response:
                return await c.post("/v1/completions", json={
                    "model": name, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
                    "ignore_eos": True})
            outs = await asyncio.gather(*(text(n) for n in ("sql", ALIAS, "chat")))
            assert [o.json()["model"] for o in outs] == ["sql", ALIAS, "chat"]
            assert [o.json()["choices"][0]["text"] for o in outs] == [
                tok.decode(want["sql"]), tok.decode(want["sql"]), tok.decode(want["chat"])]
            r = await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 200
            assert (await text("sql")).status_code == 404
            assert (await text(ALIAS)).json()["choices"][0]["text"] == tok.decode(want["sql"])
            assert len(await model.llm.call_engine(lambda e: e.list_loras())) == 2
            r = await c.post("/openai/v1/unload_lora_adapter", json={"lora_name": ALIAS})
            assert r.status_code == 200
            assert len(await model.llm.call_engine(lambda e: e.list_loras())) == 1
        model.stop_engine()
    asyncio.run(asyncio.wait_for(main(), 600))
