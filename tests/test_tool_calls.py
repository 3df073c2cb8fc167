"""Tool calling's pure parts: the request's plan, the parsers, streaming's hold-back of a
partial tag, and the structured-output request forms (kserve_paged/structured.py)."""

from __future__ import annotations

import json

import pytest

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.tools import (
    StreamedCalls,
    may_start_call,
    parse_hermes,
    parse_llama3_json,
    template_messages,
    tool_plan,
)
from kserve_paged.structured import StructuredOptionError, structured_outputs_option

F = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
G = {"type": "function", "function": {"name": "get_time"}}


def test_plan_choices():
    assert tool_plan(None, None, None, "hermes") is None
    assert tool_plan([F], "none", None, "hermes") is None
    auto = tool_plan([F, G], None, None, "hermes")
    assert auto.choice == "auto" and auto.constraint() is None
    named = tool_plan([F, G], {"type": "function", "function": {"name": "get_time"}}, None,
                      "hermes")
    assert named.constraint() == {"json": {"type": "object"}}
    required = tool_plan([F, G], "required", False, "hermes").constraint()["json"]
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2


@pytest.mark.parametrize("tools, choice, parser, param", [
    ([{"type": "retrieval"}], None, "hermes", "tools"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "hermes", "tools"),
    ([F, F], None, "hermes", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "hermes",
     "tools"),
    ([F], {"type": "function", "function": {"name": "nope"}}, "hermes", "tool_choice"),
    ([F], "sometimes", "hermes", "tool_choice"),
    (None, "required", "hermes", "tool_choice"),
    ([F], "auto", "none", "tool_choice"),
])
def test_plan_refusals_name_the_field(tools, choice, parser, param):
    with pytest.raises(APIError) as err:
        tool_plan(tools, choice, None, parser)
    assert err.value.status == 400 and err.value.param == param


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
            '</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_hermes("no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(broken) == (broken, [])


def test_llama3_json_parser():
    content, calls = parse_llama3_json(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_llama3_json("Plain answer.") == ("Plain answer.", [])
    assert parse_llama3_json('{"no_name": 1}') == ('{"no_name": 1}', [])


def test_streaming_holds_back_a_partial_tag():
    plan = tool_plan([F], "auto", None, "hermes")
    assert may_start_call(plan, "Hello <tool") == len("Hello ")
    assert may_start_call(plan, "Hello <b>") == len("Hello <b>")
    assert may_start_call(plan, "Hi <tool_call>{") == len("Hi ")
    llama = tool_plan([F], "auto", None, "llama3_json")
    assert may_start_call(llama, '  {"name"') == 0
    assert may_start_call(llama, "Sure thing") == len("Sure thing")


@pytest.mark.parametrize("choice, pieces", [
    ("auto", ["Checking. ", "<tool_", 'call>{"name": "get_weather", "arguments": ',
              '{"city": "Rome"}}</tool_call>']),
    ("auto", ["Just ", "text, ", "no call."]),
    ({"type": "function", "function": {"name": "get_weather"}}, ['{"city"', ': "Rome"}']),
    ("required", ['[{"name": "get_weather", ', '"parameters": {"city": "Rome"}}]']),
])
def test_streamed_deltas_reassemble_to_the_parsed_answer(choice, pieces):
    plan = tool_plan([F, G], choice, None, "hermes")
    streamer = StreamedCalls(plan)
    text, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        text += piece
        for delta in streamer.feed(text, finished=i == len(pieces) - 1):
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    want_content, want_calls = plan.parse(text)
    assert content.strip() == (want_content or "").strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in want_calls]


def test_template_messages_turn_arguments_into_objects():
    out = template_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}}]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


# -- structured-output request forms ------------------------------------------------------------

@pytest.mark.parametrize("options, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object"}}}}, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_object"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": '{"choice": ["a", "b"]}'}, "choice"),  # v2: a JSON string
    ({"guided_json": '{"type": "object"}'}, "json"),
    ({"guided_choice": ["x", "y"]}, "choice"),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, "grammar"),
    ({"response_format": "json_object"}, "json_object"),
])
def test_every_request_form_gives_one_constraint(options, kind):
    spec = structured_outputs_option(options)
    assert spec is not None and spec.kind == kind


def test_no_constraint_and_text_format_give_none():
    assert structured_outputs_option({}) is None
    assert structured_outputs_option({"response_format": {"type": "text"}}) is None
    assert structured_outputs_option({"response_format": "text"}) is None


@pytest.mark.parametrize("options, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_choice": "a,b"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
])
def test_bad_forms_name_their_field(options, param):
    with pytest.raises(StructuredOptionError) as err:
        structured_outputs_option(options)
    assert err.value.param == param
