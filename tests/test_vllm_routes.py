"""vLLM's routes at the root (kserve_paged/vllm_routes.py, openai/tokenize.py) on the server in
process: /health and /ping through loading, serving and a dead engine; /version; /v1/models
read by the openai client and by a KServe v1 client; /tokenize and /detokenize in vLLM's
shapes, with 400s for bad input; every served name routes."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kserve_paged.vllm_flags import VLLM_CLI_VERSION, package_version
from tests.helpers.server import NAME, V2_BODY, FakeEngine, build, client, ready, run


class DyingEngine(FakeEngine):
    """Its first step kills the engine thread."""

    def step(self):
        raise RuntimeError("the device fell off the bus")


def test_health_and_ping_follow_the_engine_through_loading_serving_and_death():
    async def main() -> None:
        gate = asyncio.Event()
        loop = asyncio.get_running_loop()

        def factory() -> DyingEngine:
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
            return DyingEngine()

        app, model = build(factory=factory)
        async with client(app) as c:
            starting = asyncio.create_task(model.start_engine())
            await asyncio.sleep(0.05)
            r = await c.get("/health")
            assert r.status_code == 503 and "loading" in r.json()["error"]
            gate.set()
            await starting
            for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
                r = await c.request(method, path)
                assert (r.status_code, r.content) == (200, b""), (method, path)
            r = await c.post("/v1/completions", json={"model": NAME, "prompt": "a",
                                                      "max_tokens": 2})
            assert r.status_code >= 500  # the step that killed the engine
            for _ in range(100):
                if model.llm.error is not None:
                    break
                await asyncio.sleep(0.01)
            for path in ("/health", "/ping"):
                r = await c.get(path)
                assert r.status_code == 503 and "device fell off" in r.json()["error"], path
        model.stop_engine()
    run(main())


def test_version():
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            assert (await c.get("/version")).json() == {
                "version": package_version(), "vllm_api_version": VLLM_CLI_VERSION}
        model.stop_engine()
    run(main())


def test_v1_models_answers_openai_and_kserve_v1_clients_under_every_served_name():
    async def main() -> None:
        app, model, _ = await ready(names=[NAME, "publishers/ns/models/m"])
        async with client(app) as c:
            body = (await c.get("/v1/models")).json()
            # KServe v1's list: the names; OpenAI's: object + data.
            assert body["models"] == [NAME, "publishers/ns/models/m"]
            assert body["object"] == "list"
            assert [m["id"] for m in body["data"]] == body["models"]
            assert (await c.get("/openai/v1/models")).json()["data"] == body["data"]
            oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=c)
            listed = [m async for m in oai.models.list()]
            assert [m.id for m in listed] == [NAME, "publishers/ns/models/m"]
            for name in body["models"]:
                r = await oai.completions.create(model=name, prompt="a b", max_tokens=2)
                assert r.model == name and r.choices[0].text == " one two"
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="other", prompt="a", max_tokens=1)
            # KServe's v1 and v2 routes still answer under the model's own name.
            assert (await c.get(f"/v1/models/{NAME}")).json() == {"name": NAME, "ready": True}
            assert (await c.post(f"/v2/models/{NAME}/infer", json=V2_BODY)).status_code == 200
        model.stop_engine()
    run(main())


def test_tokenize_a_prompt_and_chat_messages_and_detokenize():
    async def main() -> None:
        app, model, engine = await ready()
        tok = engine.tokenizer
        async with client(app) as c:
            r = await c.post("/tokenize", json={"model": NAME, "prompt": "one two six"})
            assert r.json() == {"count": 3, "max_model_len": 64,
                                "tokens": tok.encode("one two six"), "token_strs": None}
            r = await c.post("/tokenize", json={"prompt": "one two", "return_token_strs": True})
            assert r.json()["token_strs"] == [" one", " two"]
            messages = [{"role": "user", "content": "one three"}]
            r = await c.post("/tokenize", json={"messages": messages})
            want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
            assert r.json()["tokens"] == want and r.json()["count"] == len(want)
            r = await c.post("/tokenize", json={"messages": messages,
                                                "add_generation_prompt": False})
            assert r.json()["count"] == len(want) - 1  # no " <assistant>"
            r = await c.post("/detokenize", json={"model": NAME, "tokens": want[-3:]})
            assert r.json() == {"prompt": tok.decode(want[-3:])}
            assert (await c.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("path, body, where", [
    ("/tokenize", {}, "prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt or messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": 1, "content": "x"}]}, "role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, "cannot both"),
    ("/tokenize", {"prompt": "x" * 10_000}, "characters"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "other"),
    ("/detokenize", {"tokens": [1, -1]}, "out of range"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", [1, 2], "JSON object"),
])
def test_bad_tokenizer_requests_are_4xx_with_a_message(path, body, where):
    async def main() -> None:
        app, model, _ = await ready(max_prompt_chars=1000)
        async with client(app) as c:
            r = await c.post(path, json=body)
            assert r.status_code in (400, 404), r.text
            assert where in r.json()["error"]["message"]
        model.stop_engine()
    run(main())


def test_v1_models_carries_exactly_what_kserves_own_route_answers():
    """KServe's v1 handler over a repository holding the model under its served names (as
    server.serve registers them) answers {"models": [...]}: our body carries that key and
    value unchanged."""
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    from kserve.protocol.rest.v1_endpoints import V1Endpoints

    async def main() -> None:
        names = [NAME, "m-alias"]
        app, model, _ = await ready(names=names)
        registry = ModelRepository()
        for name in names:
            registry.update(model, name)
        kserve_body = await V1Endpoints(DataPlane(model_registry=registry),
                                        ModelRepositoryExtension(model_registry=registry)
                                        ).models()
        async with client(app) as c:
            ours = (await c.get("/v1/models")).json()
        assert {k: ours[k] for k in kserve_body} == kserve_body
        model.stop_engine()
    run(main())
