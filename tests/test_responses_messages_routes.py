"""/v1/responses, /v1/messages and /v1/messages/count_tokens in process, in front of the fake
engine (tests/helpers/server.py: it generates " one two three ..." one word a step): the
shapes, the refusals (400s before any work is queued, each in its protocol's error shape),
the new sampling options and --generation_config's defaults reaching the engine.
(chat_template_kwargs over the server's defaults, on chat and /tokenize alike: in
test_hostile_bodies.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server import FakeEngine, client, ready, run

ASK = [{"role": "user", "content": "hello"}]


def post(path: str, body: dict[str, Any], engine: FakeEngine | None = None,
         setup: Any = None) -> tuple[Any, FakeEngine]:
    """POST to a fresh app; the response (read) and the engine (what was queued)."""
    async def main() -> tuple[Any, FakeEngine]:
        app, model, eng = await ready(engine)
        if setup is not None:
            setup(model)
        try:
            async with client(app) as c:
                return await c.post(path, json=body), eng
        finally:
            model.stop_engine()
    return run(main())


def events(text: str) -> list[dict[str, Any]]:
    """Server-sent events with an `event:` line, as Responses and Messages send them."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"]
        out.append(payload)
    return out


@pytest.mark.parametrize("prefix", ["/v1", "/openai/v1"])
def test_a_response_whole(prefix):
    r, eng = post(f"{prefix}/responses", {"input": "hello", "instructions": "be brief",
                                          "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == " one two three"
    assert body["usage"]["output_tokens"] == 3
    prompt = eng.tokenizer.decode(eng.added[0][1])
    assert "<system> be brief" in prompt and "<user> hello" in prompt


def test_a_response_streamed_in_order():
    r, _ = post("/v1/responses", {"input": [{"role": "user", "content": "hi"}],
                                  "max_output_tokens": 2, "stream": True})
    kinds = [e["type"] for e in events(r.text)]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    seq = [e["sequence_number"] for e in events(r.text)]
    assert seq == list(range(len(seq)))


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": []}, "input"),
])
def test_response_refusals_are_400s_naming_the_field(body, param):
    r, eng = post("/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and not eng.added


def test_a_message_whole():
    """(The fake engine keeps the stop string and names none: stop_sequence's answer is in
    test_reasoning_routes.py, on the real engine.)"""
    r, eng = post("/v1/messages", {"messages": ASK, "max_tokens": 10, "system": "sys",
                                   "stop_sequences": [" three"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": " one two three"}]
    assert body["stop_reason"] == "end_turn" and body["usage"]["output_tokens"] == 3
    assert eng.added[0][2].stop == [" three"] and eng.added[0][2].max_tokens == 10
    assert eng.tokenizer.decode(eng.added[0][1]).startswith(" <system> sys <user> hello")


def test_a_message_streamed():
    r, _ = post("/v1/messages", {"messages": ASK, "max_tokens": 2, "stream": True})
    got = events(r.text)
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in got if e["type"] == "content_block_delta") \
        == " one two"
    assert got[-2]["delta"]["stop_reason"] == "max_tokens"


def test_count_tokens_is_the_rendered_prompt():
    r, eng = post("/v1/messages/count_tokens", {"messages": ASK, "system": "be brief"})
    assert r.status_code == 200 and not eng.added
    # "<system> be brief <user> hello <assistant>": six whitespace words
    assert r.json() == {"input_tokens": 6}


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/messages", {"messages": ASK}, 400, "invalid_request_error"),  # no max_tokens
    ("/v1/messages", {"messages": ASK, "max_tokens": 5, "model": "nope"}, 404,
     "not_found_error"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "x"}}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image"}]}],
                      "max_tokens": 5}, 400, "invalid_request_error"),
    ("/v1/messages/count_tokens", {"messages": ASK, "max_tokens": 5}, 400,
     "invalid_request_error"),
])
def test_message_errors_in_anthropics_shape(path, body, status, kind):
    r, eng = post(path, body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"] and not eng.added


def test_vllm_sampling_extras_reach_the_engine():
    r, eng = post("/v1/completions", {"prompt": "a b c d", "max_tokens": 2,
                                      "allowed_token_ids": [1, 2], "bad_words": ["two"],
                                      "truncate_prompt_tokens": 2})
    assert r.status_code == 200, r.text
    params = eng.added[0][2]
    assert params.allowed_token_ids == [1, 2] and params.bad_words == ["two"]
    assert params.truncate_prompt_tokens == 2
    r, _ = post("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("mode, temperature, max_tokens", [("auto", 0.25, 4),
                                                            ("vllm", 1.0, 16)])
def test_generation_config_defaults(tmp_path: Path, mode, temperature, max_tokens):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_k": 7, "max_new_tokens": 4}))
    engine = FakeEngine()
    engine.model_path = str(tmp_path)

    def choose(model):
        model.generation_config = mode
    r, eng = post("/v1/completions", {"prompt": "a"}, engine, choose)
    assert r.status_code == 200, r.text
    params = eng.added[0][2]
    assert (params.temperature, params.max_tokens) == (temperature, max_tokens)
    assert params.top_k == (7 if mode == "auto" else 0)
    r, eng = post("/v1/completions", {"prompt": "a", "temperature": 0.5, "max_tokens": 9},
                  engine, choose)
    assert (eng.added[-1][2].temperature, eng.added[-1][2].max_tokens) == (0.5, 9)


def test_a_constraint_waits_for_the_end_of_thinking_unless_the_prompt_closed_it():
    """openai/chat_turn.reasoning_gate on the fake tokenizer (a word, a token)."""
    from types import SimpleNamespace

    from kserve_paged.openai.chat_turn import reasoning_gate

    tok = FakeEngine().tokenizer
    model = SimpleNamespace(info=SimpleNamespace(tokenizer=tok))
    end = tok.encode("</think>")[0]
    assert reasoning_gate(model, tok.encode("<user> hi <assistant>")) == end
    assert reasoning_gate(model, tok.encode("<assistant> <think>")) == end
    assert reasoning_gate(model, tok.encode("<assistant> <think> </think>")) is None


def test_a_reasoning_server_gates_the_requests_constraint():
    def parser(model):
        model.reasoning_parser = "qwen3"
    r, eng = post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2,
                                           "response_format": {"type": "json_object"}},
                  setup=parser)
    assert r.status_code == 200, r.text
    spec = eng.added[0][2].structured_outputs
    assert spec.start_after_token_id == eng.tokenizer.encode("</think>")[0]
    r, eng = post("/v1/messages", {"messages": ASK, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
