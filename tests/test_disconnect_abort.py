"""A client that goes away aborts everything its request started, on every inference route:
each prompt of a multi-prompt request, each choice of n > 1, each beam, whether the client
leaves while the prompts are still being submitted, while it waits for a whole answer, or
while a stream runs. Real engines on tiny random models (a generator, an embedder, a
cross-encoder); the measure is engine steps from the disconnect until the engine is idle with
every KV block free (tests/helpers/disconnect.py), bounded by `STEPS_AFTER_LEAVING` where the
prompts alone would take `PROMPTS` steps to submit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from tests.helpers.disconnect import (
    StepCounter,
    engine_idle,
    leave_during,
    leave_during_on_loopback,
)
from tests.helpers.server import build
from tests.helpers.thinking_model import write_thinking_model
from tests.helpers.tiny_models import save_cross_encoder

pytestmark = pytest.mark.slow

PROMPTS = 64  # submitted one engine step apart: far more steps than the bound below
# Steps the engine may still take after the disconnect. The engine waits at the disconnect's
# step for the app to end (tests/helpers/disconnect.py), so a server that aborts everything
# has queued its aborts before the next step: 0, and one step of slack.
STEPS_AFTER_LEAVING = 1
ASK = "Capital of France?"
LONG = {"max_tokens": 100, "temperature": 0}  # greedy: <pad> is never sampled
MESSAGES = [{"role": "user", "content": ASK}]


class Served:
    """An app around a real engine, and the engine's step count."""

    def __init__(self, engine: LLMEngine) -> None:
        self.app, self.model = build(engine=engine)
        self.steps = StepCounter()
        self.model.llm.add_step_callback(self.steps)
        asyncio.run(self.model.start_engine())

    def leave(self, path: str, body: dict[str, Any], loopback: bool = False,
              after_steps: int = 3) -> int:
        """Steps from the disconnect to an idle engine; every KV block is free again."""
        async def main() -> int:
            go = leave_during_on_loopback if loopback else leave_during
            after = await go(self.app, self.model, self.steps, path, body, after_steps)
            assert await engine_idle(self.model)
            return after
        after = asyncio.run(asyncio.wait_for(main(), 120))
        engine = self.model.llm.engine
        assert engine.kv.num_free_blocks == engine.num_kv_blocks
        return after


@pytest.fixture(scope="module")
def endless_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking model of tests/helpers/thinking_model.py with <pad> as its end of text, a
    token it never samples: every request runs to its max_tokens, on every route (Responses
    and Messages have no ignore_eos)."""
    folder = write_thinking_model(tmp_path_factory.mktemp("endless"))
    for name, key, value in (("config.json", "eos_token_id", 0),
                             ("generation_config.json", "eos_token_id", 0),
                             ("tokenizer_config.json", "eos_token", "<pad>")):
        data = json.loads((folder / name).read_text())
        data[key] = value
        (folder / name).write_text(json.dumps(data))
    return folder


def _served(engine: LLMEngine) -> Iterator[Served]:
    served = Served(engine)
    yield served
    served.model.stop_engine()


@pytest.fixture(scope="module")
def generator(endless_folder: Path) -> Iterator[Served]:
    yield from _served(LLMEngine(EngineConfig(model=str(endless_folder), max_model_len=256,
                                              num_kv_blocks=256)))


@pytest.fixture(scope="module")
def embedder(endless_folder: Path) -> Iterator[Served]:
    yield from _served(LLMEngine(EngineConfig(model=str(endless_folder), max_model_len=256,
                                              runner="pooling", convert="embed")))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("xenc")
    save_cross_encoder(path)
    yield from _served(LLMEngine(model=str(path), dtype="float32", device="cpu"))


def v2_body(n: int, **parameters: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [n],
                        "data": [ASK] * n}], "parameters": parameters}


GENERATE = {
    "completions-multi": ("/v1/completions", {"prompt": [ASK] * PROMPTS, **LONG}),
    "completions-multi-stream": ("/v1/completions",
                                 {"prompt": [ASK] * PROMPTS, "stream": True, **LONG}),
    "completions-one": ("/openai/v1/completions", {"prompt": ASK, **LONG}),
    "completions-beam-search": ("/v1/completions", {"prompt": [ASK] * 4, "n": 2, "best_of": 3,
                                                    "use_beam_search": True, **LONG}),
    "chat-n3": ("/v1/chat/completions", {"messages": MESSAGES, "n": 3, **LONG}),
    "chat-n3-stream": ("/v1/chat/completions",
                       {"messages": MESSAGES, "n": 3, "stream": True, **LONG}),
    "responses": ("/v1/responses", {"input": ASK, "max_output_tokens": 100, "temperature": 0}),
    "responses-stream": ("/v1/responses", {"input": ASK, "max_output_tokens": 100, "temperature": 0,
                                           "stream": True}),
    "messages": ("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": 100,
                                  "temperature": 0}),
    "messages-stream": ("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": 100,
                                         "temperature": 0, "stream": True}),
    "v2-multi": ("/v2/models/m/infer", v2_body(PROMPTS, max_tokens=100, temperature=0)),
    "v1-multi": ("/v1/models/m:predict", {"instances": [ASK] * PROMPTS,
                                          "parameters": {"max_tokens": 100, "temperature": 0}}),
}


@pytest.mark.parametrize("case", list(GENERATE))
def test_leaving_aborts_every_request_of_a_generation_route(generator: Served, case: str):
    path, body = GENERATE[case]
    assert generator.leave(path, body) <= STEPS_AFTER_LEAVING


def test_leaving_through_a_real_server_aborts_prompts_not_yet_submitted(generator: Served):
    """uvicorn on loopback, the client's socket closed while the prompts are submitted."""
    after = generator.leave("/v1/completions", {"prompt": [ASK] * PROMPTS, **LONG},
                            loopback=True)
    assert after <= STEPS_AFTER_LEAVING


@pytest.mark.parametrize("case", ["completions-multi", "chat-n3", "messages"])
def test_leaving_before_the_prompts_are_queued_starts_nothing(generator: Served, case: str):
    """The client leaves as soon as its body is sent: the handler is cancelled while it
    renders and tokenizes, before any prompt reaches the engine."""
    path, body = GENERATE[case]
    assert generator.leave(path, body, after_steps=0) == 0


POOL = {
    "embeddings": ("embedder", "/v1/embeddings", {"input": [ASK] * PROMPTS}),
    "v2-embeddings": ("embedder", "/v2/models/m/infer", v2_body(PROMPTS)),
    "rerank": ("cross_encoder", "/rerank",
               {"query": "the cat", "documents": [f"the cat sat {'on ' * i}the mat"
                                                  for i in range(PROMPTS)]}),
    "score": ("cross_encoder", "/v1/score",
              {"text_1": "the cat", "text_2": [f"a dog {'ran ' * i}fast"
                                               for i in range(PROMPTS)]}),
    "classify": ("cross_encoder", "/classify",
                 {"input": [f"the {'blue ' * i}cat" for i in range(PROMPTS)]}),
}


@pytest.mark.parametrize("case", list(POOL))
def test_leaving_stops_a_pooling_request_submitting(request: pytest.FixtureRequest, case: str):
    """Each input of a pooling request is one engine step: the client's leaving ends them."""
    fixture, path, body = POOL[case]
    served: Served = request.getfixturevalue(fixture)
    assert served.leave(path, body) <= STEPS_AFTER_LEAVING


def test_a_finished_request_is_answered_whole(generator: Served):
    """The disconnect watch does not cut short a request whose client stays: the response
    arrives whole, the engine idle after it."""
    from tests.helpers.server import client

    async def main() -> None:
        async with client(generator.app) as c:
            r = await c.post("/v1/completions", json={"prompt": [ASK] * 3, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 3
            assert await engine_idle(generator.model)
    asyncio.run(main())
