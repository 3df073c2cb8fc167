"""Request options through the server's routes on the real default model, with the offline
``LLM`` (same engine, same options) as the reference: what test_server_options.py and
test_server_options_chat.py share, session-scoped fixtures (tests/conftest.py exposes them) so
the default model is loaded twice per session, not twice per file. Requests are short: these
run on CPU."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # tests/conftest.py imports this module: keep its collection light
    from kserve_paged.model import PagedLLMModel
    from kserve_paged_engine import LLM

OPTS = {"max_model_len": 256, "num_kv_blocks": 64}
PROMPTS = ["The capital of France is", "1, 2, 3,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CMPL = "/openai/v1/completions"
CHAT_URL = "/openai/v1/chat/completions"
V2 = "/v2/models/m/infer"  # tests/helpers/server.NAME
TOL = 2e-3  # batch composition changes float sums a little between server and reference


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    return str(ensure_default_model(progress=lambda _: None))


@pytest.fixture(scope="session")
def served(model_dir: str) -> Iterator[tuple[Any, PagedLLMModel]]:
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from tests.helpers.server import build

    app, model = build(engine=LLMEngine(EngineConfig(model=model_dir, **OPTS)))
    asyncio.run(model.start_engine())
    yield app, model
    model.stop_engine()


@pytest.fixture(scope="session")
def ref(model_dir: str) -> LLM:
    from kserve_paged_engine import LLM

    return LLM(model=model_dir, **OPTS)


def call(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any]) -> Any:
    """POST ``body``; the httpx response (read)."""
    from tests.helpers.server import client

    app, _ = served

    async def main() -> Any:
        async with client(app) as c:
            return await c.post(path, json=body)
    return asyncio.run(asyncio.wait_for(main(), 120))


def ok(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any]) -> Any:
    from tests.helpers.server import sse

    r = call(served, path, body)
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else sse(r.text)


def refused(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any],
            param: str) -> str:
    r = call(served, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error"
    return err["message"]


def chat_ids(ref: LLM) -> list[int]:
    return ref.apply_chat_template(CHAT)


