"""The typed Messages and Responses bodies (kserve_paged/anthropic/body.py,
kserve_paged/openai/responses_body.py) take what the `openai` and `anthropic` clients send,
and the clients read the answers as their own types: the SDKs against the app in process,
in front of the fake engine (tests/helpers/server.py). The malformed bodies are in
tests/test_hostile_bodies.py."""

from __future__ import annotations

import anthropic
import httpx2
import openai

from tests.helpers.server import client, ready, run


def test_the_sdks_requests_validate_and_their_clients_read_the_answers():
    """The `openai` and `anthropic` clients against the app in process: a multi-turn request
    carrying what each SDK sends back from earlier turns is served, and each client reads
    the answer as its own types."""
    async def main() -> None:
        app, model, eng = await ready()
        model.tool_call_parser = "hermes"
        try:
            async with client(app) as http:
                oa = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)
                response = await oa.responses.create(
                    model="m", instructions="Be brief.", max_output_tokens=3,
                    input=[{"role": "user", "content": "Oslo?"},
                           {"type": "function_call", "id": "fc_1", "call_id": "c1",
                            "name": "weather", "arguments": '{"city": "Oslo"}',
                            "status": "completed"},
                           {"type": "function_call_output", "call_id": "c1",
                            "output": "rain"}],
                    tools=[{"type": "function", "name": "weather", "strict": False,
                            "parameters": {"type": "object"}}],
                    text={"format": {"type": "text"}}, reasoning={"effort": "low"})
                assert response.output_text == " one two three"
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                          base_url="http://t", timeout=20) as http2:
                # (the anthropic SDK brings its own httpx, httpx2)
                an = anthropic.AsyncAnthropic(base_url="http://t", api_key="k",
                                              http_client=http2)
                messages = [
                    {"role": "user", "content": "Oslo?"},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "weather",
                         "input": {"city": "Oslo"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "rain",
                         "cache_control": {"type": "ephemeral"}}]}]
                tools = [{"name": "weather", "description": "Weather of a city",
                          "input_schema": {"type": "object",
                                           "properties": {"city": {"type": "string"}}}}]
                message = await an.messages.create(
                    model="m", max_tokens=3, messages=messages, tools=tools,
                    tool_choice={"type": "auto"}, system="Be brief.",
                    thinking={"type": "disabled"})
                assert message.content[0].text == " one two three"
                count = await an.messages.count_tokens(model="m", messages=messages,
                                                       tools=tools)
                assert count.input_tokens > 0
        finally:
            model.stop_engine()
        assert len(eng.added) == 2
    run(main())
