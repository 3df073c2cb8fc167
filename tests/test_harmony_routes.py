"""Harmony (gpt-oss' chat format) behind the routes, with the real `openai` client in process:
the deterministic tiny gpt-oss models of tests/helpers/harmony_model.py think `The user asks` on
the analysis channel, then answer `Paris.` on the final channel or call `get_weather`. With
`--tool-call-parser openai` (Harmony turned on) chat returns `message.reasoning` and
`tool_calls`, Responses returns reasoning and function-call items, streamed and not, and a
structured output holds the final channel while the analysis runs free. Slow: the module
starts two real engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from tests.helpers.harmony_model import (
    ANSWER,
    ARGUMENTS,
    REASONING,
    TOOL,
    WEATHER_TOOL,
    write_harmony_model,
)
from tests.helpers.server import build

pytestmark = [pytest.mark.slow]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _app(folder: Any) -> Any:
    app, model = build(engine=LLMEngine(EngineConfig(model=str(folder), max_model_len=512,
                                                     num_kv_blocks=48)))
    model.tool_call_parser = "openai"  # what --tool-call-parser openai sets
    asyncio.run(model.start_engine())
    app.state.model = model
    return app, model


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    built = {ending: _app(write_harmony_model(tmp_path_factory.mktemp(ending), ending))
             for ending in ("final", "tool")}
    yield {ending: app for ending, (app, _) in built.items()}
    for _, model in built.values():
        model.stop_engine()


def call(app: Any, work: Any) -> Any:
    import openai

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as http:
            oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="-", http_client=http,
                                     max_retries=0)
            return await work(oai)
    return asyncio.run(asyncio.wait_for(main(), 120))


def chat(app: Any, stream: bool, **args: Any) -> dict[str, Any]:
    """The first choice's reasoning, content, tool calls and finish reason, joined from the
    deltas when streamed."""
    async def work(oai: Any) -> dict[str, Any]:
        base = {"model": "m", "messages": ASK, "temperature": 0, **args}
        if not stream:
            choice = (await oai.chat.completions.create(**base)).choices[0]
            m = choice.message
            assert getattr(m, "reasoning_content", None) == m.reasoning
            return {"reasoning": m.reasoning, "content": m.content, "reason":
                    choice.finish_reason, "calls": [(c.function.name, c.function.arguments, c.id)
                                                    for c in m.tool_calls or []]}
        thought, said, calls, reason = [], [], {}, None
        async for chunk in await oai.chat.completions.create(stream=True, **base):
            for choice in chunk.choices:
                thought.append(getattr(choice.delta, "reasoning", None) or "")
                said.append(choice.delta.content or "")
                for c in choice.delta.tool_calls or []:
                    name, arguments, cid = calls.get(c.index, ("", "", None))
                    calls[c.index] = (name + (c.function.name or ""),
                                      arguments + (c.function.arguments or ""), cid or c.id)
                reason = choice.finish_reason or reason
        return {"reasoning": "".join(thought) or None, "content": "".join(said) or None,
                "reason": reason, "calls": [calls[i] for i in sorted(calls)]}
    return call(app, work)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_and_answer(apps, stream):
    got = chat(apps["final"], stream)
    assert got["reasoning"] == REASONING and got["content"] == ANSWER
    assert got["reason"] == "stop" and got["calls"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_and_tool_call(apps, stream):
    got = chat(apps["tool"], stream, tools=[WEATHER_TOOL])
    assert got["reasoning"] == REASONING and got["content"] is None
    ((name, arguments, call_id),) = got["calls"]
    assert (name, json.loads(arguments)) == (TOOL, json.loads(ARGUMENTS))
    assert call_id and got["reason"] == "tool_calls"


def test_the_tool_result_goes_back_through_the_template(apps):
    """The call and its result rendered into the next prompt (the model just calls again)."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": TOOL, "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 20}'}]
    got = chat(apps["tool"], False, tools=[WEATHER_TOOL], messages=history)
    assert got["reasoning"] == REASONING and got["calls"][0][0] == TOOL


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_holds_the_final_channel_only(apps, stream):
    """A choice the model would never make: the analysis runs free, the answer is the
    choice (a grammar active from the first token would have cut the thinking)."""
    got = chat(apps["final"], stream, extra_body={"structured_outputs": {"choice": ["Lyon."]}})
    assert got["reasoning"] == REASONING and got["content"] == "Lyon."


def test_responses_reasoning_and_function_call_items(apps):
    async def work(oai: Any) -> tuple[Any, Any, list[str]]:
        args = {"model": "m", "input": "Weather in Paris?", "temperature": 0,
                "tools": [{"type": "function", **WEATHER_TOOL["function"]}]}
        whole = await oai.responses.create(**args)
        kinds = []
        async with oai.responses.stream(**args) as s:
            async for event in s:
                kinds.append(event.type)
            final = await s.get_final_response()
        return whole, final, kinds
    whole, final, kinds = call(apps["tool"], work)
    for response in (whole, final):
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[0].content[0].text == REASONING
        assert response.output[1].name == TOOL
        assert json.loads(response.output[1].arguments) == json.loads(ARGUMENTS)
    assert "response.reasoning_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds


def test_responses_reasoning_and_message(apps):
    async def work(oai: Any) -> Any:
        return await oai.responses.create(model="m", input="Weather in Paris?", temperature=0)
    response = call(apps["final"], work)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == REASONING
    assert response.output_text == ANSWER
