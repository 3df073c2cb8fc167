"""KServe's gpt-oss LLMInferenceService sample, single node: its container's own command
(`/bin/sh -c 'vllm serve /mnt/models --served-model-name ... $VLLM_ADDITIONAL_ARGS'`,
tests/helpers/gpt_oss_sample.py) with our `vllm` on PATH, serving a tiny gpt-oss checkpoint
(tests/helpers/harmony_model.py: a random tiny GptOssForCausalLM whose greedy turn is fixed) with
Harmony's flags in `VLLM_ADDITIONAL_ARGS`.

Checked through the `openai` client: chat returns the analysis channel as `message.reasoning` and
the `commentary to=functions.get_weather` message as a tool call, whole and streamed; Responses
returns a reasoning item and a function-call item; the server drains and stops on SIGTERM.
"""

from __future__ import annotations

import json
import signal

import openai
import pytest

from kserve_paged.testing import ServerProcess, free_port
from tests.helpers.gpt_oss_sample import (
    HARMONY_ARGS,
    MODEL_NAME,
    sample_command,
    sample_env,
    vllm_bin,
)
from tests.helpers.harmony_model import (
    ARGUMENTS,
    REASONING,
    TOOL,
    WEATHER_TOOL,
    write_harmony_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_the_samples_command_serves_harmony_reasoning_and_tool_calls(tmp_path):
    model = write_harmony_model(tmp_path / "models", "tool")
    port = free_port()
    # The port and host a test on a shared machine needs (the last --port wins), a small cache.
    extra = ["--port", str(port), "--host", "127.0.0.1", "--max-model-len", "512",
             "--num-kv-blocks", "64", *HARMONY_ARGS]
    process = ServerProcess(sample_command(model),
                            [f"http://127.0.0.1:{port}/health"],
                            env=sample_env(vllm_bin(tmp_path / "bin"), extra),
                            log_path=tmp_path / "server.log", timeout_s=600)
    try:
        process.start()
        _check(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                             max_retries=0, timeout=120))
    finally:
        code = process.stop(grace_s=40)  # SIGTERM to the group: the shell and the server
    # The sample's `/bin/sh -c` does not exec its command (dash), so the shell itself dies of
    # the group's SIGTERM; the server under it drains and exits.
    assert code in (0, -signal.SIGTERM), process.tail(60)
    assert "Application shutdown complete" in process.log(), process.tail(60)


def _check(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    args = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER_TOOL], "temperature": 0}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.message.reasoning == REASONING and choice.finish_reason == "tool_calls"
    ((call,),) = [choice.message.tool_calls]
    assert call.function.name == TOOL
    assert json.loads(call.function.arguments) == json.loads(ARGUMENTS)

    thought, name, arguments = "", "", ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning", None) or ""
            for part in c.delta.tool_calls or []:
                name += part.function.name or ""
                arguments += part.function.arguments or ""
    assert (thought, name, json.loads(arguments)) == (REASONING, TOOL, json.loads(ARGUMENTS))

    response = client.responses.create(
        model=MODEL_NAME, input="Weather in Paris?", temperature=0,
        tools=[{"type": "function", **WEATHER_TOOL["function"]}])
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == REASONING
    assert response.output[1].name == TOOL
