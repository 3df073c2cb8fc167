"""OpenAI's Responses API and Anthropic's Messages API against the real server (issue 31):
the `openai` client's responses.create and stream helpers (plain, tools, json_schema), the
`anthropic` client's messages.create and stream helpers (plain, tools) and count_tokens, on the
default model; and a tiny thinking model served with `--reasoning_parser qwen3` and
`--default_chat_template_kwargs`, its thinking apart from its answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.helpers.e2e_server import MODEL, Server, running_server
from tests.helpers.thinking_model import ANSWER, REASONING, write_thinking_model

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "strict": True,
                  "description": "Current weather in a city", "parameters": WEATHER_SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                  "input_schema": WEATHER_SCHEMA}
ASK = "What is the weather in Paris?"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def oai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def ant(server: Server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="-", timeout=300, max_retries=0)


def test_responses_plain(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                             max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_responses_tools(oai, tool_choice):
    r = oai.responses.create(model=MODEL, input=ASK, tools=[RESPONSES_TOOL],
                             tool_choice=tool_choice, max_output_tokens=120, temperature=0,
                             parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    # the call's result sent back as input items: accepted
    follow = oai.responses.create(model=MODEL, tools=[RESPONSES_TOOL], max_output_tokens=4,
                                  input=[{"role": "user", "content": ASK}, calls[0].model_dump(),
                                         {"type": "function_call_output",
                                          "call_id": calls[0].call_id, "output": "21 C"}])
    assert follow.status in ("completed", "incomplete")


def test_responses_json_schema(oai):
    r = oai.responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City,
                            max_output_tokens=80, temperature=0)
    assert isinstance(r.output_parsed, City) and r.status == "completed"


def test_responses_streamed(oai):
    """Cut at max_output_tokens, the stream ends in `response.incomplete` (OpenAI's event;
    the helper's get_final_response is for `response.completed` only)."""
    deltas, kinds = [], []
    with oai.responses.stream(model=MODEL, input="Count to five.", max_output_tokens=12,
                              temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    final = event.response
    assert final.status == kinds[-1].split(".")[1]
    assert "".join(deltas) == final.output_text


def test_responses_streamed_tool_call(oai):
    args: list[str] = []
    with oai.responses.stream(model=MODEL, input=ASK, tools=[RESPONSES_TOOL],
                              tool_choice="required", max_output_tokens=120, temperature=0,
                              parallel_tool_calls=False) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                args.append(event.delta)
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert "".join(args) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_responses_refuses_stored_state(oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_abc")
    with pytest.raises(openai.BadRequestError, match="store"):
        oai.responses.create(model=MODEL, input="x", store=True)


def test_messages_plain(ant):
    m = ant.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                            messages=[{"role": "user", "content": "Say hello."}])
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 8


def test_messages_tools_and_a_tool_result(ant):
    m = ant.messages.create(model=MODEL, max_tokens=120, tools=[ANTHROPIC_TOOL],
                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                            messages=[{"role": "user", "content": ASK}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    follow = ant.messages.create(model=MODEL, max_tokens=4, tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_messages_streamed_text_and_tool_use(ant):
    with ant.messages.stream(model=MODEL, max_tokens=12,
                             messages=[{"role": "user", "content": "Count to five."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text
    partial: list[str] = []
    with ant.messages.stream(model=MODEL, max_tokens=120, tools=[ANTHROPIC_TOOL],
                             tool_choice={"type": "tool", "name": "get_weather"},
                             messages=[{"role": "user", "content": ASK}]) as s:
        for event in s:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = s.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert json.loads("".join(partial)) == use.input
    jsonschema.validate(use.input, WEATHER_SCHEMA)


def test_messages_count_tokens(ant):
    messages = [{"role": "user", "content": "Say hello."}]
    count = ant.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    m = ant.messages.create(model=MODEL, max_tokens=1, messages=messages, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens > 0


# -- a thinking model behind --reasoning_parser -----------------------------------------------

@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder: Path = write_thinking_model(tmp_path_factory.mktemp("think"))
    with running_server(["--model_dir", str(folder), "--reasoning_parser", "qwen3",
                         "--default_chat_template_kwargs", '{"enable_thinking": false}'],
                        engine_opts={"max_model_len": 128, "num_kv_blocks": 32}) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_model_on_the_real_server(thinking, stream):
    import openai

    client = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="-", max_retries=0)

    def ask(**extra: Any) -> tuple[str, str]:
        args = {"model": MODEL, "temperature": 0, "extra_body": extra,
                "messages": [{"role": "user", "content": "Capital of France?"}]}
        if not stream:
            message = client.chat.completions.create(**args).choices[0].message
            return message.reasoning or "", message.content or ""
        thought, said = "", ""
        for chunk in client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                thought += getattr(c.delta, "reasoning", None) or ""
                said += c.delta.content or ""
        return thought, said

    assert ask() == ("", ask()[1]) and ask()[1].strip() == ANSWER  # the server's default: off
    reasoning, content = ask(chat_template_kwargs={"enable_thinking": True})
    assert reasoning.strip() == REASONING and content.strip() == ANSWER


def test_the_docs_example_runs(server: Server, capsys):
    """docs/serving.md's Responses/Messages example, as written but for the server's address."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    section = text[text.index("## Responses, Messages and reasoning models"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://localhost:8080" in code
    exec(compile(code.replace("http://localhost:8080", server.url), "serving.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[0].strip() and printed[1].strip()
    assert int(printed[2]) > 0  # count_tokens' input_tokens
