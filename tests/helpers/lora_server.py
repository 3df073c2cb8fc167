"""The server in process with a real engine over a tiny base and LoRA runtime updates on
(the adapter-loading tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from kserve.model_repository import ModelRepository
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import RESTServer
from prometheus_client import CollectorRegistry

from kserve_paged import server as srv
from kserve_paged.metrics import EngineMetrics
from kserve_paged.model import PagedLLMModel
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.async_llm import AsyncLLM

PROMPT = list(range(100, 120))


def build_lora_app(base: Path, roots: list[str], lora_modules: list[tuple[str, str]] | None = None,
                   *, names: list[str] | None = None, **engine: Any
                   ) -> tuple[FastAPI, PagedLLMModel, httpx.AsyncClient]:
    """Model "base" with adapter "a1" from ``<first root>/a1`` unless ``lora_modules`` says
    otherwise; runtime loads confined to ``roots``; also served under the further ``names``
    (KServe model aliases too, as server.serve registers them); ``engine``: EngineConfig
    options over the defaults here."""
    options: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                               "num_kv_blocks": 128, "max_model_len": 128, **engine}
    config = EngineConfig(model=str(base), **options)
    modules = lora_modules if lora_modules is not None else [("a1", f"{roots[0]}/a1")]
    model = PagedLLMModel("base", config, llm=AsyncLLM(config),
                          metrics=EngineMetrics("base", registry=CollectorRegistry()),
                          lora_modules=modules)
    model.load()
    registry = ModelRepository()
    registry.update(model)
    for alias in (names or [])[1:]:
        registry.update(model, alias)
    model.repository = registry
    app = FastAPI()
    srv.install(app, model, lora_runtime_updates=True, lora_roots=roots, names=names)
    rest = RESTServer("kserve.model_server:app", DataPlane(model_registry=registry),
                      ModelRepositoryExtension(model_registry=registry), 0)
    rest._register_endpoints(app)
    rest._add_exception_handlers(app)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                               timeout=60)
    return app, model, client


async def complete(client: httpx.AsyncClient, model: str) -> str:
    r = await client.post("/openai/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]
