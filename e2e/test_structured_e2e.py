"""Structured outputs, tool calls and prompt scoring end to end (issue 18): the openai client,
a v2 client and lm-evaluation-harness against the real server on the default model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kserve_paged_engine import SamplingParams
from tests.helpers.e2e_server import MODEL, Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 24}},
        "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def oai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused", timeout=300,
                         max_retries=0)


def test_chat_completions_parse_with_a_pydantic_model(oai):
    result = oai.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=120, temperature=0)
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, City) and result.choices[0].finish_reason == "stop"


def test_completions_json_schema_for_every_sample(oai):
    schema = City.model_json_schema()
    result = oai.completions.create(
        model=MODEL, prompt="A city record in JSON:", max_tokens=120, temperature=1.0, n=4,
        seed=3, extra_body={"structured_outputs": {"json": schema}})
    assert len(result.choices) == 4
    for choice in result.choices:
        jsonschema.validate(json.loads(choice.text), schema)


def test_v2_guided_regex_and_choice(server: Server):
    def infer(parameters: dict[str, Any]) -> str:
        body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                            "data": ["The answer:"]}], "parameters": parameters}
        r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["outputs"][0]["data"][0]

    text = infer({"max_tokens": 16, "temperature": 1.0, "guided_regex": "[A-Z][a-z]{2,5}!"})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}!", text), text
    text = infer({"max_tokens": 8, "structured_outputs": json.dumps({"choice": ["up", "down"]})})
    assert text in ("up", "down")
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", timeout=60, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "parameters": {"guided_json": '{"type": "objekt"}'}})
    assert r.status_code == 400 and "objekt" in r.text


def test_tool_choice_required_always_gives_valid_calls(oai):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    result = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4, temperature=1.0,
        seed=5, max_tokens=160, parallel_tool_calls=False)  # one call: the model cannot loop
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name])


def _reassemble(chunks) -> tuple[list[dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"])
def test_a_streamed_tool_call_reassembles_to_the_same_call(oai, tool_choice):
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 0, "max_tokens": 160, "parallel_tool_calls": False}
    whole = oai.chat.completions.create(**args).choices[0]
    streamed, reason = _reassemble(oai.chat.completions.create(**args, stream=True))
    want = [{"name": c.function.name, "arguments": c.function.arguments}
            for c in whole.message.tool_calls]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed] == want
    assert all(c["id"] for c in streamed)
    assert reason == whole.finish_reason == "tool_calls"


def test_tool_results_in_the_history_are_accepted(oai):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    result = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         max_tokens=8, temperature=0)
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- lm-evaluation-harness ----------------------------------------------------------------------

CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue"], "answer": 1},
]
GEN_DOCS = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "What color is the sky?", "answer": "blue"}]


def _task_files(tmp: Path) -> Path:
    (tmp / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CHOICE_DOCS))
    (tmp / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (tmp / "kp_choice.yaml").write_text(f"""task: kp_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp / "kp_gen.yaml").write_text(f"""task: kp_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return tmp


def test_lm_eval_harness_loglikelihood_and_generate_until(server: Server, offline_llm,
                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    from lm_eval import evaluator
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(base_url=f"{server.url}/openai/v1/completions", model=MODEL,
                             tokenizer=offline_llm.engine.model_path,
                             tokenizer_backend="huggingface", max_length=1024)
    results = evaluator.simple_evaluate(
        model=lm, tasks=["kp_choice", "kp_gen"],
        task_manager=TaskManager(include_path=str(_task_files(tmp_path)),
                                 include_defaults=False),
        log_samples=True, bootstrap_iters=0)
    assert results is not None
    assert set(results["results"]) == {"kp_choice", "kp_gen"}
    assert 0.0 <= results["results"]["kp_choice"]["acc,none"] <= 1.0
    # The harness's loglikelihoods are the offline engine's prompt logprobs, summed over the
    # continuation.
    for sample in results["samples"]["kp_choice"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            ids = ctx_ids + cont_ids
            out = offline_llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0),
                                       use_tqdm=False)[0]
            want = sum(out.prompt_logprobs[p][ids[p]].logprob
                       for p in range(len(ctx_ids), len(ids)))
            assert resp[0][0] == pytest.approx(want, abs=2e-3)
    generated = [s["resps"][0][0] for s in results["samples"]["kp_gen"]]
    for doc, text in zip(GEN_DOCS, generated):
        prompt = f"Question: {doc['question']}\nAnswer:"
        want = offline_llm.generate([prompt], SamplingParams(
            temperature=0, max_tokens=8, stop=["\n"]), use_tqdm=False)[0].outputs[0].text
        assert text == want


def test_echo_with_max_tokens_0_returns_the_scored_prompt(oai, offline_llm):
    prompt = "The capital of France is Paris"
    result = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = result.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == result.usage.prompt_tokens
    assert result.usage.completion_tokens == 0
    ids = offline_llm.engine.tokenize(prompt)
    want = offline_llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0),
                                use_tqdm=False)[0]
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(want.prompt_logprobs[p][ids[p]].logprob,
                                                     abs=2e-3)
