"""Harmony's pure parts: gpt-oss output text read back into reasoning, answer and tool calls
(whole and streamed a character at a time), the chat template's rendering, the structured-output
gate on a token sequence, when Harmony is on, and vLLM's flag names for it."""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import pytest

from kserve_paged.args import parse_args
from kserve_paged.openai.chat_turn import split_turn, turn_reasoning_parser
from kserve_paged.openai.harmony import HARMONY_PARSER, HarmonyStream, Header, parse_harmony
from kserve_paged.openai.harmony_template import HARMONY_CHAT_TEMPLATE
from kserve_paged.openai.tools import tool_plan
from kserve_paged.openai.turn import TurnStream
from kserve_paged.vllm_cli import serve_argv
from kserve_paged_engine.sample.structured_output import RequestGrammar

F = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "The city"},
                                          "unit": {"type": "string", "enum": ["c", "f"],
                                                   "default": "c"},
                                          "days": {"type": ["integer", "null"]},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
                                          "required": ["city"]}}}
THINK = "<|channel|>analysis<|message|>The user asks about <weather>.<|end|>"
FINAL = THINK + "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b>.<|return|>"
CALL = (THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
TWO_CALLS = (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
             '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
             '{"city": "Paris"}<|call|><|start|>assistant<|channel|>commentary '
             'to=functions.get_time<|message|>{}<|call|>')


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (FINAL, "The user asks about <weather>.", "It is <b>sunny</b>.", []),
    (CALL, "The user asks about <weather>.", None, [("get_weather", '{"city": "Paris"}')]),
    (TWO_CALLS, "The user asks about <weather>.", "Checking both.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("<|channel|>analysis<|message|>cut off while thinking", "cut off while thinking", None,
     []),
    # gpt-oss' built-in tools (not ours to run) are the model's own work: reasoning.
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>", '{"q": 1}', None,
     []),
    ("no Harmony at all", None, "no Harmony at all", []),
    ("<|channel|>final<|message|>", None, None, []),
])
def test_whole_outputs(text, reasoning, content, calls):
    got_reasoning, got_content, got_calls = parse_harmony(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize("text", [FINAL, CALL, TWO_CALLS])
def test_streamed_a_character_at_a_time_equals_whole(text):
    stream = HarmonyStream()
    reasoning, content, names, arguments = "", "", [], {}
    for i, ch in enumerate(text):
        piece = stream.feed(ch, final=i == len(text) - 1)
        assert "<|" not in piece.reasoning + piece.content  # no tag shown, not even half
        reasoning += piece.reasoning
        content += piece.content
        for index, call in piece.new_calls:
            assert index not in arguments  # the name is known before any argument
            names.append(call.name)
            arguments[index] = ""
        for index, part in piece.arguments:
            arguments[index] += part
    whole_reasoning, whole_content, whole_calls = parse_harmony(text)
    assert (reasoning, content or None) == (whole_reasoning, whole_content)
    assert list(zip(names, arguments.values(), strict=True)) == [
        (c.name, c.arguments) for c in whole_calls]


def test_turn_stream_with_tools_auto_streams_the_call_and_counts_it():
    turn = TurnStream(tool_plan([F], "auto", None, "openai"), HARMONY_PARSER)
    pieces = [p for i, tok in enumerate(re.split(r"(<\|[a-z]+\|>)", CALL))
              for p in turn.feed(tok, finished=i == len(re.split(r"(<\|[a-z]+\|>)", CALL)) - 1)]
    assert "".join(p.reasoning for p in pieces) == "The user asks about <weather>."
    assert "".join(p.content for p in pieces) == ""
    parts = [c for p in pieces for c in p.calls]
    assert parts[0].name == "get_weather" and parts[0].id == turn.calls[0].id
    assert "".join(c.arguments for c in parts) == '{"city": "Paris"}'
    assert turn.finish_reason("stop") == "tool_calls"


def test_without_tools_a_call_is_not_reported():
    turn = TurnStream(None, HARMONY_PARSER)
    pieces = turn.feed(CALL, finished=True)
    assert not any(p.calls for p in pieces) and turn.finish_reason("stop") == "stop"
    assert split_turn(CALL, None, HARMONY_PARSER)[2] == []


def test_a_required_call_is_the_final_channels_json():
    plan = tool_plan([F], "required", None, "openai")
    text = THINK + ('<|start|>assistant<|channel|>final<|message|>'
                    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]<|return|>')
    reasoning, content, calls = split_turn(text, plan, HARMONY_PARSER)
    assert reasoning == "The user asks about <weather>." and content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                    {"city": "Oslo"})]
    turn = TurnStream(plan, HARMONY_PARSER)
    pieces = turn.feed(text, finished=True)
    assert [c.name for p in pieces for c in p.calls] == ["get_weather"]


def _render(messages, **kw):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(HARMONY_CHAT_TEMPLATE).render(messages=messages, **kw)


def test_template_renders_system_tools_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Hi.", "reasoning": "old turn's thought"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 20}'}]
    text = _render(messages, tools=[F, {"type": "function", "function": {"name": "now"}}],
                   add_generation_prompt=True, reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "\n\nReasoning: low\n\n# Valid channels: analysis, commentary, final." in text
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
            "## functions\n\nnamespace functions {\n\n// Weather now.\n"
            "type get_weather = (_: {\n// The city\ncity: string,\n"
            'unit?: "c" | "f", // default: c\ndays?: number | null,\ntags?: string[],\n'
            "}) => any;\n\ntype now = () => any;\n\n} // namespace functions<|end|>") in text
    assert "old turn's thought" not in text  # a finished turn's reasoning is dropped
    assert ("<|start|>assistant<|channel|>final<|message|>Hi.<|end|>"
            "<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            '<|constrain|>json<|message|>{"city": "Paris"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            '{"t": 20}<|end|><|start|>assistant') in text
    assert text.endswith("<|start|>assistant")


def test_template_without_system_or_tools_has_no_developer_message():
    text = _render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert "developer" not in text and "Calls to these tools" not in text
    assert "Reasoning: medium" in text
    assert text.endswith("<|start|>user<|message|>hi<|end|>")


@pytest.mark.parametrize("header", ["assistant<|channel|><|constrain|>",
                                    "assistant<|channel|> <|constrain|> ", "assistant"])
def test_a_header_without_a_channel_name_reads_as_none(header):
    """The header is model output: `<|channel|><|constrain|>` with no name raised IndexError,
    a 500 (or a broken stream) instead of text."""
    parsed = Header.parse(header)
    assert parsed.channel == "" and parsed.recipient is None


def test_the_gate_waits_for_the_whole_token_sequence():
    gate = RequestGrammar(concurrent.futures.Future(), (7, 8, 9))
    for token in (7, 8, 1, 7, 9, 8, 9):  # near misses: 7 8 (then 1), 8 9 without 7
        assert gate.accept(token) and not gate.active
    gate.accept(7), gate.accept(8)
    assert not gate.active
    gate.accept(9)
    assert gate.active
    assert not RequestGrammar(concurrent.futures.Future(), 4).active  # one token, as before


def test_when_harmony_is_on(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert turn_reasoning_parser(None, "hermes", str(tmp_path)) == HARMONY_PARSER
    assert turn_reasoning_parser(None, "openai", str(other)) == HARMONY_PARSER
    assert turn_reasoning_parser(None, "hermes", str(other)) is None
    assert turn_reasoning_parser("qwen3", "hermes", str(tmp_path)) == "qwen3"  # as asked


def test_vllm_flag_names_parse():
    args = parse_args(serve_argv(["/mnt/models", "--reasoning-parser", "openai_gptoss",
                                  "--tool-call-parser", "openai", "--enable-auto-tool-choice"]))
    assert (args.reasoning_parser, args.tool_call_parser) == ("openai_gptoss", "openai")
    assert args.enable_auto_tool_choice


def test_kserves_gpt_oss_sample_command_line_parses(tmp_path: Path):
    """The sample's `/bin/sh -c 'vllm serve /mnt/models ... $VLLM_ADDITIONAL_ARGS'` as its
    container runs it (tests/helpers/gpt_oss_sample.py), with Harmony's flags added."""
    from tests.helpers.gpt_oss_sample import HARMONY_ARGS, MODEL_NAME, sample_argv

    argv = sample_argv(Path("/mnt/models"), HARMONY_ARGS, tmp_path / "bin")
    assert argv[:2] == ["serve", "/mnt/models"]
    args = parse_args(serve_argv(argv[1:]))
    assert args.served_model_name == [MODEL_NAME] and args.http_port == 8000
    assert args.disable_uvicorn_access_log and args.disable_log_requests
    assert (args.reasoning_parser, args.tool_call_parser) == (HARMONY_PARSER, "openai")


def test_a_gpt_oss_checkpoint_without_a_template_gets_ours(tmp_path: Path):
    from types import SimpleNamespace

    from kserve_paged.openai.chat_turn import fallback_template
    from kserve_paged.openai.errors import APIError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    info = SimpleNamespace(has_chat_template=False, model_path=str(tmp_path))
    model = SimpleNamespace(info=info, reasoning_parser=None, tool_call_parser="hermes")
    assert fallback_template(model, "x") == {"chat_template": HARMONY_CHAT_TEMPLATE}
    model.reasoning_parser = "qwen3"  # not a Harmony turn: no template is no chat
    with pytest.raises(APIError) as err:
        fallback_template(model, "use /completions")
    assert err.value.status == 400 and "use /completions" in err.value.message
    info.has_chat_template = True
    assert fallback_template(model, "x") == {}


def test_reasoning_effort_reaches_the_template_under_the_requests_own_kwargs():
    from types import SimpleNamespace

    from kserve_paged.openai.chat_turn import template_kwargs
    from kserve_paged.openai.errors import APIError
    from kserve_paged.openai.schemas import ChatBody, validate

    model = SimpleNamespace(default_chat_template_kwargs={"reasoning_effort": "low"})
    ask = [{"role": "user", "content": "hi"}]
    body = validate(ChatBody, {"messages": ask, "reasoning_effort": "high"})
    assert template_kwargs(model, body) == {"reasoning_effort": "high"}
    body = validate(ChatBody, {"messages": ask, "reasoning_effort": "high",
                               "chat_template_kwargs": {"reasoning_effort": "medium"}})
    assert template_kwargs(model, body) == {"reasoning_effort": "medium"}
    assert template_kwargs(model, validate(ChatBody, {"messages": ask})) == {
        "reasoning_effort": "low"}
    with pytest.raises(APIError) as err:
        validate(ChatBody, {"messages": ask, "reasoning_effort": "extreme"})
    assert err.value.status == 400 and err.value.param == "reasoning_effort"
