"""The OpenAI routes in process (tests/helpers/server.py: KServe's routes + ours, a fake
engine): completions and chat, streaming, the chat template, refusals, vLLM's paths."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.server import (
    NAME,
    client,
    ready,
    run,
    sse,
)

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
    /v1/chat/completions (manifests/llmisvc): the same handlers answer there; /v1/models
    answers both KServe v1's model list and OpenAI's (tests/test_vllm_routes.py)."""
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
            assert (await c.get("/v1/models")).json()["models"] == [NAME]
        model.stop_engine()
    run(main())


