"""Issue 49 items 1-3 in process, in front of the fake engine (tests/helpers/server.py):
malformed Messages and Responses bodies are 400s naming the field (typed after the SDKs'
types: anthropic/body.py, openai/responses_body.py), never a 500; JSON in a body field nested
past limits.MAX_JSON_DEPTH is a 400 naming the bound on every route that renders it
(json_depth.py); a full waiting queue is a 429 with Retry-After on every generating route,
/v1/messages included; /tokenize renders under chat's template and tool rules."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kserve_paged.json_depth import JSONTooDeep, check_depth, loads
from kserve_paged_engine import limits
from tests.helpers.server import FakeEngine, client, ready, run

ASK = [{"role": "user", "content": "hello"}]
DEEP_TEXT = "[" * 30_000 + "]" * 30_000  # past the interpreter's own recursion limit


def nested(depth: int) -> Any:
    """A JSON object ``depth`` levels deep: {"a": {"a": ... {} }}."""
    value: Any = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def send(requests: list[tuple[str, dict[str, Any]]], engine: FakeEngine | None = None,
         setup: Any = None) -> tuple[list[Any], FakeEngine]:
    """POST each body to one fresh app, in order; the responses and the engine."""
    async def main() -> tuple[list[Any], FakeEngine]:
        app, model, eng = await ready(engine)
        if setup is not None:
            setup(model)
        try:
            async with client(app) as c:
                return [await c.post(path, json=body) for path, body in requests], eng
        finally:
            model.stop_engine()
    return run(main())


def assert_refused(r: Any, status: int = 400) -> str:
    """The response is a ``status`` in its protocol's error shape; its message."""
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]  # Anthropic's shape and OpenAI's alike
    assert message and "internal error" not in message
    return message


# -- item 1: malformed Messages and Responses bodies ------------------------------------------

def _tool_result(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": content}]}]


MALFORMED = [
    # the probes: each was an AttributeError (500)
    ("/v1/messages", {"max_tokens": 3, "messages": _tool_result([1, None])},
     "messages[0].content[0].tool_result.content[0]"),
    ("/v1/messages", {"max_tokens": 3, "messages": _tool_result({"a": 1})},
     "messages[0].content[0].tool_result.content"),
    ("/v1/messages/count_tokens", {"messages": _tool_result([1, None])},
     "messages[0].content[0].tool_result.content[0]"),
    ("/v1/messages/count_tokens", {"messages": _tool_result({"a": 1})},
     "messages[0].content[0].tool_result.content"),
    ("/v1/responses", {"input": "hi", "text": {"format": "json_object"}}, "text.format"),
    ("/v1/responses", {"input": "hi", "text": {"format": 3}}, "text.format"),
    # more of the same kind: a wrong type where the SDK's type says otherwise
    ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": {"x": 1}}]}]}, "messages[0].content[0].text.text"),
    ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages[0].content[0].tool_use.input"),
    ("/v1/messages", {"max_tokens": 3, "messages": ASK, "system": [{"type": "text"}]},
     "system[0].text.text"),
    ("/v1/messages", {"max_tokens": 3, "messages": ASK, "tool_choice": "auto"},
     "tool_choice"),
    ("/v1/messages", {"max_tokens": 3, "messages": ASK, "thinking": {"type": "sometimes"}},
     "thinking"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": {"city": "Oslo"}}]},
     "input[0].function_call.arguments"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                  "output": 5}]}, "input[0].function_call_output.output"),
    ("/v1/responses", {"input": [{"role": "user", "content": [1]}]},
     "input[0].message.content[0]"),
    ("/v1/responses", {"input": "hi", "tool_choice": 7}, "tool_choice"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": {"a": 1}}}, "reasoning.effort"),
]


@pytest.mark.parametrize("path, body, where", MALFORMED)
def test_malformed_bodies_are_400s_naming_the_field(path, body, where):
    [r], eng = send([(path, body)])
    assert where in assert_refused(r)
    assert not eng.added  # refused before any work was queued


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Oslo?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "rain"}],
                                      "is_error": False}]}],
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"}}),
    ("/v1/responses", {"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Rain.", "annotations": []}]}],
        "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"},
                   "strict": None}], "tool_choice": "auto",
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}},
                 "verbosity": "low"}}),
])
def test_well_formed_bodies_with_the_sdks_extra_fields_are_served(path, body):
    """What the SDKs send back from earlier turns (ids, statuses, cache_control) is no 400."""
    def parser(model):
        model.tool_call_parser = "hermes"
    [r], eng = send([(path, body)], setup=parser)
    assert r.status_code == 200, r.text
    assert len(eng.added) == 1


def test_a_response_echoes_the_requests_settings():
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}}
    [r], _ = send([("/v1/responses", {"input": "hi", "text": {"format": fmt},
                                      "reasoning": {"effort": "low"}})])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == {"format": fmt} and body["reasoning"] == {"effort": "low"}
    assert body["tools"] == [] and body["tool_choice"] == "auto"


# -- the depth bound on JSON inside a body field ----------------------------------------------

def _call_message(arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


DEEP = [
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [_call_message(DEEP_TEXT)]}),
    ("/tokenize", {"messages": [_call_message(DEEP_TEXT)]}),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                                  "arguments": DEEP_TEXT}]}),
    # Past the bound, within what the body's own parser takes: an object, not text.
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        _call_message(json.dumps(nested(limits.MAX_JSON_DEPTH + 1)))]}),
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        _call_message(nested(limits.MAX_JSON_DEPTH + 1))]}),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f",
         "input": nested(limits.MAX_JSON_DEPTH + 1)}]}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": nested(500)}]}]}),
]


@pytest.mark.parametrize("path, body", DEEP, ids=lambda v: v if isinstance(v, str) else "")
def test_deep_json_in_a_field_is_a_400_naming_the_bound(path, body):
    [r], eng = send([(path, body)])
    message = assert_refused(r)
    assert f"more than {limits.MAX_JSON_DEPTH} levels deep" in message
    assert not eng.added


@pytest.mark.parametrize("name", ["response_format", "structured_outputs", "guided_json",
                                  "logit_bias"])
def test_deep_json_text_in_a_v2_parameter_is_a_400_naming_the_bound(name):
    """v2 parameters are scalars: a constraint comes as JSON text (kserve_paged/structured.py)."""
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                        "data": ["a b"]}], "parameters": {"max_tokens": 2, name: DEEP_TEXT}}
    [r], eng = send([("/v2/models/m/infer", body)])
    assert r.status_code == 400, r.text
    assert f"{name} is nested more than {limits.MAX_JSON_DEPTH} levels" in r.json()["error"]
    assert not eng.added


def test_deep_schema_text_in_chat_structured_outputs_is_a_400_naming_the_bound():
    """Chat's ``structured_outputs.json`` may be schema text, parsed where the grammar is built
    (output_constraints.py): past the interpreter's own limit it named a RecursionError."""
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"json": DEEP_TEXT}}
    [r], eng = send([("/v1/chat/completions", body)])
    message = assert_refused(r)
    assert f"more than {limits.MAX_SCHEMA_DEPTH} levels deep" in message
    assert "recursion" not in message
    assert not eng.added


def test_json_at_the_bound_is_rendered():
    at = json.dumps(nested(limits.MAX_JSON_DEPTH))
    [r], eng = send([("/v1/chat/completions", {"max_tokens": 2, "messages": [
        _call_message(at), {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})])
    assert r.status_code == 200, r.text
    assert len(eng.added) == 1


def test_the_depth_bound_itself():
    check_depth(nested(limits.MAX_JSON_DEPTH), "x")
    check_depth([[[]]] * 1000, "x")  # wide is not deep
    with pytest.raises(JSONTooDeep, match="x is nested more than"):
        check_depth(nested(limits.MAX_JSON_DEPTH + 1), "x")
    with pytest.raises(JSONTooDeep):
        loads(DEEP_TEXT, "x")
    with pytest.raises(ValueError) as exc:
        loads("{not json", "x")
    assert not isinstance(exc.value, JSONTooDeep)
    assert loads('{"a": [1, "[[["]}', "x") == {"a": [1, "[[["]}


def test_deep_model_output_is_text_not_a_crash():
    """A model's tool-call text nested past the bound is read as no call (text), on each
    parser and in a Message's tool_use input; before, a RecursionError ended the request."""
    from kserve_paged.anthropic.convert import tool_input
    from kserve_paged.openai.tools import parse_hermes, parse_llama3_json, tool_plan

    body = '{"name": "f", "arguments": ' + DEEP_TEXT + "}"
    assert parse_hermes(f"<tool_call>{body}</tool_call>")[1] == []
    assert parse_llama3_json(body)[1] == []
    plan = tool_plan([{"type": "function", "function": {"name": "f"}}], "required", None,
                     "hermes")
    assert plan.parse(DEEP_TEXT) == (DEEP_TEXT, [])
    assert tool_input(DEEP_TEXT) == {"_raw": DEEP_TEXT}


# -- item 2: a full waiting queue is a 429 on every generating route --------------------------

class FullQueueEngine(FakeEngine):
    """Reports requests waiting: with --max_waiting_requests 1, every new one is refused."""

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "num_waiting": 3}


GENERATING = [
    ("/openai/v1/completions", {"prompt": "a b", "max_tokens": 2}),
    ("/openai/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/openai/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}),
    ("/v1/messages", {"messages": ASK, "max_tokens": 2}),
    ("/v1/messages", {"messages": ASK, "max_tokens": 2, "stream": True}),
]


@pytest.mark.parametrize("path, body", GENERATING)
def test_a_full_queue_is_a_429_with_retry_after_on_every_route(path, body):
    def full(model):
        model.max_waiting_requests = 1
    [r], eng = send([(path, body)], FullQueueEngine(), full)
    message = assert_refused(r, 429)
    assert "--max_waiting_requests 1" in message
    assert r.headers["retry-after"] == str(limits.QUEUE_FULL_RETRY_AFTER_S)
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error"  # Anthropic's type and OpenAI's alike
    assert not eng.added


# -- item 3: /tokenize under chat's template and tool rules -----------------------------------

TOOLS_OVER_CAP = [{"type": "function", "function": {"name": f"f{i}"}}
                  for i in range(limits.MAX_TOOLS + 1)]


@pytest.mark.parametrize("extra, param", [
    ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ({"tools": TOOLS_OVER_CAP}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(
        limits.MAX_SCHEMA_DEPTH + 1)}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": nested(
        limits.MAX_JSON_DEPTH + 1)}}]}, "tools"),
])
def test_tokenize_refuses_what_chat_refuses(extra, param):
    for path in ("/tokenize", "/v1/chat/completions"):
        [r], eng = send([(path, {"messages": ASK, "max_tokens": 2, **extra})])
        assert_refused(r)
        assert r.json()["error"]["param"] == param, (path, r.text)
        assert not eng.added


def test_tokenize_renders_with_chats_template_kwargs_and_tools():
    """The same template arguments reach the template from /tokenize as from chat: the
    server's default kwargs under the request's, and the checked tools."""
    seen: list[dict[str, Any]] = []
    engine = FakeEngine()
    render = engine.tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen.append(kw)
        return render(messages, **kw)
    engine.tokenizer.apply_chat_template = spy

    def setup(model):
        model.default_chat_template_kwargs = {"enable_thinking": False, "x": 1}
        model.tool_call_parser = "hermes"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": ASK, "tools": tools, "chat_template_kwargs": {"enable_thinking": True}}
    [tok, chat], _ = send([("/tokenize", body),
                           ("/v1/chat/completions", {**body, "max_tokens": 1})], engine, setup)
    assert tok.status_code == 200 and chat.status_code == 200, (tok.text, chat.text)
    assert seen[0] == seen[1]
    assert seen[0]["enable_thinking"] is True and seen[0]["x"] == 1
    assert seen[0]["tools"] == tools
