"""A thinking model behind the routes, with the real `openai` and `anthropic` clients (in
process, through ASGI transports): the tiny Qwen3 of tests/helpers/thinking_model.py thinks
"The user asks" and answers "Paris." when its template lets it, and answers at once when
`enable_thinking` is false. With `--reasoning_parser qwen3` the thinking comes back apart:
chat's `message.reasoning`, Responses' reasoning items, Messages' thinking blocks; streamed
and not. Slow: each test module starts the real engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from tests.helpers.server import build
from tests.helpers.thinking_model import ANSWER, REASONING, write_thinking_model

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = write_thinking_model(tmp_path_factory.mktemp("think"))
    app, model = build(engine=LLMEngine(EngineConfig(model=str(folder), max_model_len=128,
                                                     num_kv_blocks=32)))
    model.reasoning_parser = "qwen3"
    asyncio.run(model.start_engine())
    app.state.model = model
    yield app
    model.stop_engine()


def call(app: Any, work: Any) -> Any:
    """Run `work(openai_client, anthropic_client)` against the app."""
    import anthropic
    import httpx2
    import openai

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as h1, \
                httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                   base_url="http://t", timeout=60) as h2:
            oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="-", http_client=h1,
                                     max_retries=0)
            ant = anthropic.AsyncAnthropic(base_url="http://t", api_key="-", http_client=h2,
                                           max_retries=0)
            return await work(oai, ant)
    return asyncio.run(asyncio.wait_for(main(), 120))


def chat(app: Any, stream: bool, **extra: Any) -> tuple[str | None, str | None]:
    """(reasoning, content) of a greedy chat completion, joined from deltas when streamed."""
    async def work(oai: Any, _: Any) -> tuple[str | None, str | None]:
        args = {"model": "m", "messages": ASK, "temperature": 0, "extra_body": extra}
        if not stream:
            message = (await oai.chat.completions.create(**args)).choices[0].message
            assert getattr(message, "reasoning_content", None) == message.reasoning
            return message.reasoning, message.content
        thought, said = [], []
        async for chunk in await oai.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                thought.append(getattr(choice.delta, "reasoning", None) or "")
                said.append(choice.delta.content or "")
        return "".join(thought) or None, "".join(said)
    return call(app, work)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_thinking_off_and_on(app, stream):
    reasoning, content = chat(app, stream, chat_template_kwargs={"enable_thinking": False})
    assert reasoning is None and content.strip() == ANSWER
    reasoning, content = chat(app, stream, chat_template_kwargs={"enable_thinking": True})
    assert reasoning.strip() == REASONING and content.strip() == ANSWER
    assert "<think>" not in content and "</think>" not in content


def test_server_default_template_kwargs_and_a_request_over_them(app):
    model = app.state.model
    model.default_chat_template_kwargs = {"enable_thinking": False}
    try:
        assert chat(app, False)[0] is None
        assert chat(app, False, chat_template_kwargs={"enable_thinking": True})[0] is not None
    finally:
        model.default_chat_template_kwargs = {}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_holds_the_answer_after_the_thinking(app, stream):
    """A choice the model would never make: the thinking runs free, the answer is the choice;
    with thinking off (closed in the prompt) the choice holds from the first token."""
    forced = {"structured_outputs": {"choice": ["France?"]}}
    reasoning, content = chat(app, stream, **forced)
    assert reasoning.strip() == REASONING and content.strip() == "France?"
    reasoning, content = chat(app, stream, chat_template_kwargs={"enable_thinking": False},
                              **forced)
    assert reasoning is None and content.strip() == "France?"


def test_responses_reasoning_items_whole_and_streamed(app):
    async def work(oai: Any, _: Any) -> tuple[Any, Any, list[str]]:
        whole = await oai.responses.create(model="m", input="Capital of France?",
                                           temperature=0)
        kinds = []
        async with oai.responses.stream(model="m", input="Capital of France?",
                                        temperature=0) as s:
            async for event in s:
                kinds.append(event.type)
            final = await s.get_final_response()
        return whole, final, kinds
    whole, final, kinds = call(app, work)
    for response in (whole, final):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text.strip() == REASONING
        assert response.output_text.strip() == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == 3  # The user asks
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"


def test_messages_thinking_blocks_whole_and_streamed(app):
    async def work(_: Any, ant: Any) -> tuple[Any, Any, Any]:
        args = {"model": "m", "max_tokens": 20, "messages": ASK}
        whole = await ant.messages.create(**args)
        async with ant.messages.stream(**args) as s:
            async for _event in s:
                pass
            streamed = await s.get_final_message()
        off = await ant.messages.create(thinking={"type": "disabled"}, **args)
        return whole, streamed, off
    whole, streamed, off = call(app, work)
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking.strip() == REASONING
        assert message.content[1].text.strip() == ANSWER and message.stop_reason == "end_turn"
    assert [b.type for b in off.content] == ["text"]


def test_messages_stop_sequence_and_count_tokens(app):
    async def work(_: Any, ant: Any) -> tuple[Any, Any]:
        stopped = await ant.messages.create(model="m", max_tokens=20, messages=ASK,
                                            stop_sequences=["asks"])
        count = await ant.messages.count_tokens(model="m", messages=ASK)
        return stopped, count
    stopped, count = call(app, work)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "asks"
    assert count.input_tokens == stopped.usage.input_tokens > 0
