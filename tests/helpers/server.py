"""The server in process for tests: KServe's routes and ours on a fresh FastAPI app, in front
of a deterministic fake engine (or a real one), reached through httpx without a socket.

`build` assembles the app as ModelServer does (RESTServer's endpoint registration and exception
handlers) plus kserve_paged.server.install; `ready` also starts the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
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
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kserve_paged_engine.sampling_params import SamplingParams

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


async def ready(engine: FakeEngine | None = None, **build_options: Any
                ) -> tuple[FastAPI, PagedLLMModel, FakeEngine]:
    engine = engine or FakeEngine()
    app, model = build(engine=engine, **build_options)
    await model.start_engine()
    return app, model, engine
