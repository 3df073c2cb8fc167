"""Responses and Messages requests as chat requests, and streamed turns rendered as their events;
the events are replayed through the `openai` and `anthropic` clients' own stream accumulators,
which refuse an event out of order (kserve_paged/openai/responses_*.py, kserve_paged/anthropic/).
The servers' routes are tested against the real clients in tests/test_server_gateway_routes.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from kserve_paged.anthropic import convert as msg
from kserve_paged.anthropic.stream import MessageEvents
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.responses_convert import (
    ResponsesBody,
    chat_request,
    response_object,
    usage_object,
)
from kserve_paged.openai.responses_stream import ResponsesEvents
from kserve_paged.openai.tools import tool_plan
from kserve_paged.openai.turn import TurnStream

WEATHER = {"type": "function", "name": "weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_responses_input_items_become_chat_messages() -> None:
    body = ResponsesBody(
        model="m", instructions="Be brief.", max_output_tokens=20, temperature=0.5,
        tools=[WEATHER], tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        reasoning={"effort": "low"},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "function_call", "call_id": "c1", "name": "weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
               {"role": "developer", "content": "Answer in French."}])
    chat = chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "system", "content": "Answer in French."}]
    assert chat["max_completion_tokens"] == 20 and chat["temperature"] == 0.5
    assert chat["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_what_a_stateless_text_server_cannot_do_is_a_400(fields: dict, param: str) -> None:
    body = ResponsesBody(**{"input": "hi", **fields})
    with pytest.raises(APIError) as exc:
        chat_request(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_unknown_responses_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="background"):
        ResponsesBody(input="hi", background=True)


def _pieces(text_deltas: list[str], plan=None, reasoning: str | None = None):
    turn = TurnStream(plan, reasoning)
    for i, delta in enumerate(text_deltas):
        yield from turn.feed(delta, finished=i == len(text_deltas) - 1)


def _replay_responses(events: list[str]) -> Any:
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)
    final = None
    for text in events:
        data = json.loads(text.split("data: ", 1)[1])
        assert text.startswith(f"event: {data['type']}\n")
        for out in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data)):
            if out.type == "response.completed":
                final = out.response
    return final


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_streamed_response_events_satisfy_the_openai_client(parser: str | None) -> None:
    body = ResponsesBody(input="hi", tools=[WEATHER])
    plan = tool_plan([{"type": "function", "function": {"name": "weather"}}], "auto", None,
                     "hermes")

    def build(output, status, usage, reason):
        return response_object(body, response_id="resp_1", model="m", created=1, output=output,
                               status=status, usage=usage, incomplete_reason=reason)

    text = ("<think>need weather</think>\n\n" if parser else "") + (
        'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
    render = ResponsesEvents(build)
    events = render.start()
    for piece in _pieces([text[i:i + 3] for i in range(0, len(text), 3)], plan, parser):
        events += render.piece(piece)
    events += render.finish("completed", usage_object(3, 9), None)
    response = _replay_responses(events)
    kinds = [item.type for item in response.output]
    assert kinds == (["reasoning"] if parser else []) + ["message", "function_call"]
    assert response.output_text == "Checking. "
    call = response.output[-1]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Oslo"}
    if parser:
        assert response.output[0].content[0].text == "need weather"
    assert response.usage.total_tokens == 12


def test_messages_blocks_become_chat_messages() -> None:
    body = msg.MessagesBody(
        model="m", max_tokens=50, system=[{"type": "text", "text": "Be kind."}],
        stop_sequences=["END"], top_k=5, thinking={"type": "disabled"},
        tools=[{"name": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                {"type": "text", "text": "And?"}]}])
    chat = msg.chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "user", "content": "And?"}]
    assert chat["max_completion_tokens"] == 50 and chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["top_k"] == 5


@pytest.mark.parametrize(("content", "match"), [
    ([{"type": "image", "source": {}}], "image"),
    ([{"type": "document"}], "document")])
def test_unsupported_blocks_are_named(content: list, match: str) -> None:
    body = msg.MessagesBody(max_tokens=5, messages=[{"role": "user", "content": content}])
    with pytest.raises(APIError, match=match):
        msg.chat_request(body)


@pytest.mark.parametrize(("args", "expected"), [
    (("stop", None, False, None), ("end_turn", None)),
    (("stop", "END", False, ["END"]), ("stop_sequence", "END")),
    (("length", None, False, None), ("max_tokens", None)),
    (("stop", None, True, None), ("tool_use", None))])
def test_stop_reasons(args: tuple, expected: tuple) -> None:
    assert msg.stop_reason(*args) == expected


@pytest.mark.parametrize("named", [False, True])
def test_streamed_message_events_satisfy_the_anthropic_client(named: bool) -> None:
    tools = [{"type": "function", "function": {"name": "weather"}}]
    if named:
        plan = tool_plan(tools, {"type": "function", "function": {"name": "weather"}}, None,
                         "hermes")
        text = '{"city": "Oslo"}'
    else:
        plan = tool_plan(tools, "auto", None, "hermes")
        text = 'Sure. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    render = MessageEvents("msg_1", "m", input_tokens=7)
    events = render.start()
    for piece in _pieces([text[i:i + 4] for i in range(0, len(text), 4)], plan, "qwen3"):
        events += render.piece(piece)
    events += render.finish("tool_use", None, 11)
    snapshot = None
    bufs: dict[int, bytes] = {}
    for text_event in events:
        data = json.loads(text_event.split("data: ", 1)[1])
        event = construct_type(type_=RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    kinds = [b.type for b in snapshot.content]
    assert kinds == (["tool_use"] if named else ["text", "tool_use"])
    assert snapshot.content[-1].input == {"city": "Oslo"}
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 11
    assert render.blocks[-1]["input"] == {"city": "Oslo"}
