"""Structured outputs in the engine (xgrammar), on the default model: every sample of a
constrained request obeys its constraint, at temperature 1 too, through n > 1, preemption,
prefix caching, stop strings and max_tokens; prompt scoring (max_tokens=0)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kserve_paged_engine.frontend.default_model import ensure_default_model
from kserve_paged_engine.frontend.llm import LLM
from kserve_paged_engine.sampling_params import SamplingParams, StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "customer": {"type": "object", "properties": {
            "email": {"type": "string", "maxLength": 24},
            "vip": {"type": "boolean"}}, "required": ["email", "vip"],
            "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(ensure_default_model(progress=lambda _: None)), num_kv_blocks=256,
               max_model_len=1024, dtype="float32")


def _texts(llm: LLM, prompt: str, params: SamplingParams) -> list[tuple[str, str]]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return [(c.text, c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
@pytest.mark.slow
def test_json_schema_holds_for_every_sample_at_temperature_1(llm, schema):
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=160,
                            structured_outputs={"json": schema})
    results = _texts(llm, "Write one record as JSON:", params)
    assert len(results) == 8
    for text, reason in results:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), schema)
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_regex_and_choice_hold(llm):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for text, reason in _texts(llm, "A code:", SamplingParams(
            n=6, temperature=1.0, seed=3, max_tokens=20,
            structured_outputs={"regex": pattern})):
        assert re.fullmatch(pattern, text) and reason == "stop", text
    choices = ["yes", "no", 'maybe "so"', "été"]
    seen = set()
    for text, reason in _texts(llm, "Answer:", SamplingParams(
            n=12, temperature=1.5, seed=5, max_tokens=20,
            structured_outputs=StructuredOutputs(choice=choices))):
        assert text in choices and reason == "stop"
        seen.add(text)
    assert len(seen) > 1  # sampling, not one forced answer


@pytest.mark.slow
def test_json_object_and_grammar(llm):
    text, reason = _texts(llm, "A JSON object about a cat:", SamplingParams(
        temperature=0, max_tokens=120, structured_outputs={"json_object": True}))[0]
    assert reason == "stop" and isinstance(json.loads(text), dict)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text, _ in _texts(llm, "A sum:", SamplingParams(
            n=4, temperature=1.0, seed=1, max_tokens=30,
            structured_outputs={"grammar": grammar})):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


@pytest.mark.slow
def test_length_cut_says_length_and_stop_string_cuts(llm):
    text, reason = _texts(llm, "Write one record as JSON:", SamplingParams(
        temperature=0, max_tokens=5, structured_outputs={"json": ORDER}))[0]
    assert reason == "length" and text.startswith("{")
    full, _ = _texts(llm, "Write one record as JSON:", SamplingParams(
        temperature=0, max_tokens=160, structured_outputs={"json": ORDER}))[0]
    cut, reason = _texts(llm, "Write one record as JSON:", SamplingParams(
        temperature=0, max_tokens=160, stop=['"customer"'],
        structured_outputs={"json": ORDER}))[0]
    assert reason == "stop" and full.startswith(cut) and len(cut) < len(full)


@pytest.mark.slow
def test_constrained_and_free_requests_share_steps_and_greedy_is_deterministic(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    constrained = SamplingParams(temperature=0, max_tokens=160,
                                 structured_outputs={"json": PERSON})
    alone = llm.generate(["Describe a person:"], constrained, use_tqdm=False)[0]
    free_alone = llm.generate(["Once upon a time"], free, use_tqdm=False)[0]
    mixed = llm.generate(["Once upon a time", "Describe a person:"], [free, constrained],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == free_alone.outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.slow
def test_preemption_keeps_the_matcher_in_step():
    """A KV cache too small for all samples at once: requests are preempted and recomputed,
    and every output still validates (the matcher is not reset by a recompute)."""
    llm = LLM(model=str(ensure_default_model(progress=lambda _: None)), num_kv_blocks=14,
              block_size=16, max_model_len=200, dtype="float32")
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=120,
                            structured_outputs={"json": ORDER})
    results = _texts(llm, "Write one order record as JSON, with all fields filled:", params)
    assert llm.stats()["num_preemptions"] > 0
    for text, reason in results:
        if reason == "stop":
            jsonschema.validate(json.loads(text), ORDER)
        else:
            assert reason == "length"
    assert sum(reason == "stop" for _, reason in results) >= 4
    assert llm.stats()["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("spec, match", [
    ({"json": {"type": "strin"}}, "Unsupported type"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(ab"}, "parenthesis"),
    ({"grammar": "root ::= foo"}, "not defined"),
    ({"choice": []}, "choice"),
    ({"json": PERSON, "regex": "a"}, "exactly one"),
    ({}, "exactly one"),
])
def test_invalid_constraints_raise_before_queueing(llm, spec, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    s = llm.stats()
    assert s["num_waiting"] == 0 and s["kv_blocks_in_use"] == 0


def test_constraints_that_could_leave_no_token_are_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs={"json_object": True})


def test_abort_while_compiling_frees_everything(llm):
    engine = llm.engine
    schema = {**PERSON, "title": "abort-test"}  # not cached yet: it must compile
    engine.add_request("compiling", "Describe:", SamplingParams(
        structured_outputs={"json": schema}, max_tokens=50))
    assert engine.scheduler.num_waiting == 1
    engine.abort_request("compiling")
    while engine.has_unfinished_requests():
        engine.step()
    s = llm.stats()
    assert s["num_waiting"] == 0 and s["num_running"] == 0 and s["kv_blocks_in_use"] == 0


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm):
    prompt = "The capital of France is Paris."
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0),
                          use_tqdm=False)[0]
    generated = llm.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=0,
                                                      temperature=0), use_tqdm=False)[0]
    c = scored.outputs[0]
    assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    assert scored.prompt_logprobs[0] is None
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    for a, b in zip(scored.prompt_logprobs[1:], generated.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_a_failed_compile_fails_only_its_request(llm, monkeypatch):
    engine = llm.engine
    real = engine.grammars._compile

    def compile_or_fail(spec):
        if "must-fail" in spec.key:
            raise RuntimeError("simulated compiler failure")
        return real(spec)

    monkeypatch.setattr(engine.grammars, "_compile", compile_or_fail)
    bad = SamplingParams(max_tokens=8, structured_outputs={"regex": "must-fail[0-9]"})
    good = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("bad", "Hi", bad)
    engine.add_request("good", "Hello there", good)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert "did not compile" in (outputs["bad"].error or "")
    assert outputs["good"].error is None and len(outputs["good"].outputs[0].token_ids) == 4
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_max_tokens_0_with_n_samples_scores_the_prompt_n_times(llm):
    out = llm.generate(["Score this prompt."], SamplingParams(max_tokens=0, n=3,
                                                             prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [[], [], []]
    assert {c.finish_reason for c in out.outputs} == {"length"}
    assert llm.stats()["kv_blocks_in_use"] == 0
