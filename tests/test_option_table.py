"""Issue 50 item 4: each request option is named once (kserve_paged/request_options.OPTIONS),
and every one of them reaches the engine's SamplingParams from an OpenAI body and from v2
parameters alike; the request's deadline is an argument that reaches the engine from every
route (kserve_paged/admission.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kserve_paged.admission import DEADLINE_HEADER, headers_deadline, sealed_deadline
from kserve_paged.openai.schemas import ChatBody, CompletionBody
from kserve_paged.request_options import OPTIONS, OptionError, SamplingRequest
from tests.helpers.server import NAME, client, ready, run

V2 = f"/v2/models/{NAME}/infer"
CMPL = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
BEAM = {"use_beam_search": True}

# Per option: its value in an OpenAI body, in v2 parameters (scalars, as tritonclient and
# gRPC carry them), the SamplingParams value both must become, and the options it needs.
SAMPLES: dict[str, tuple[Any, Any, Any, dict[str, Any]]] = {
    "max_tokens": (5, "5", 5, {}),
    "temperature": (0.5, "0.5", 0.5, {}),
    "top_p": (0.9, "0.9", 0.9, {}),
    "top_k": (7, "7", 7, {}),
    "min_p": (0.1, "0.1", 0.1, {}),
    "seed": (3, "3", 3, {}),
    "stop": ("x", "x", ["x"], {}),
    "ignore_eos": (True, "true", True, {}),
    "min_tokens": (2, "2", 2, {}),
    "stop_token_ids": ([3], "3", [3], {}),
    "n": (2, "2", 2, {}),
    "presence_penalty": (0.5, "0.5", 0.5, {}),
    "frequency_penalty": (0.25, "0.25", 0.25, {}),
    "repetition_penalty": (1.2, "1.2", 1.2, {}),
    "logit_bias": ({"3": 1.5}, '{"3": 1.5}', {3: 1.5}, {}),
    "logprobs": (2, "2", 2, {}),
    "prompt_logprobs": (1, "1", 1, {}),
    "include_stop_str_in_output": (True, "1", True, {}),
    "skip_special_tokens": (False, "false", False, {}),
    "use_beam_search": (True, "true", True, {}),
    "best_of": (3, "3", 3, BEAM),
    "length_penalty": (0.5, "0.5", 0.5, BEAM),
    "early_stopping": ("never", "never", "never", BEAM),
    "allowed_token_ids": ([3, 4], "3,4", [3, 4], {}),
    "bad_words": (["foo"], "foo", ["foo"], {}),
    "truncate_prompt_tokens": (2, "2", 2, {}),
}


def test_every_option_of_the_table_has_a_sample_and_a_body_field():
    assert set(SAMPLES) == set(OPTIONS)
    for name in OPTIONS:  # declared from the table, or by each body itself (logprobs)
        assert name in CompletionBody.model_fields and name in ChatBody.model_fields, name


def _added_params(path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                  answered: bool = True) -> list[tuple[Any, dict[str, Any]]]:
    """POST to a fresh app; per request queued, its SamplingParams and add()'s keywords (the
    time the request was sent in ``"sent"``, the time it reached add() in ``"queued"``). ``answered``: the fake engine can answer it
    (it makes one sample per request, so v2 cannot shape n > 1 of them)."""
    async def main() -> tuple[Any, list[tuple[Any, dict[str, Any]]]]:
        app, model, _ = await ready()
        added: list[tuple[Any, dict[str, Any]]] = []
        add = model.llm.add

        async def spy(prompt: Any, params: Any, *args: Any, **kw: Any) -> Any:
            added.append((params, {**kw, "sent": sent, "queued": time.monotonic()}))
            return await add(prompt, params, *args, **kw)
        model.llm.add = spy
        try:
            async with client(app) as c:
                sent = time.monotonic()
                try:
                    r = await c.post(path, json=body, headers=headers or {})
                except ValueError:  # v2 shaping n samples the fake engine never made
                    if answered:
                        raise
                    r = None
        finally:
            model.stop_engine()
        return r, added
    r, added = run(main())
    assert not answered or r.status_code == 200, r.text
    assert added, r and r.text
    return added


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_option_reaches_sampling_params_from_openai_and_v2(name: str):
    body_value, v2_value, expected, needs = SAMPLES[name]
    openai = _added_params(CMPL, {"prompt": "a b c", name: body_value, **needs})
    v2 = _added_params(V2, {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                        "shape": [1], "data": ["a b c"]}],
                            "parameters": {name: v2_value, **needs}}, answered=name != "n")
    for (params, _), where in ((openai[0], "openai"), (v2[0], "v2")):
        assert getattr(params, name) == expected, (where, name)


def test_chat_spellings_reach_the_same_fields():
    """Chat's own spellings: max_completion_tokens, logprobs as a flag with top_logprobs,
    a structured output (response_format); v2 spells the constraint as JSON text."""
    params, _ = _added_params(CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 3, "logprobs": True,
                                     "top_logprobs": 2,
                                     "response_format": {"type": "json_object"}})[0]
    assert (params.max_tokens, params.logprobs) == (3, 2)
    assert params.structured_outputs.kind == "json_object"
    params, _ = _added_params(V2, {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                               "shape": [1], "data": ["a"]}],
                                   "parameters": {"structured_outputs": '{"regex": "a+"}'}})[0]
    assert params.structured_outputs.kind == "regex"


def test_a_plain_request_sets_only_what_it_gives():
    params, _ = _added_params(CMPL, {"prompt": "a b"})[0]
    assert (params.temperature, params.structured_outputs, params.logprobs) == (1.0, None, None)
    assert params.max_tokens == 16  # the endpoint's default budget


# -- the deadline, an argument from the route to the engine -------------------------------

def _deadline_of(path: str, body: dict[str, Any], headers: dict[str, str]
                 ) -> tuple[float, float] | None:
    """The timeout the request got, as the window it must lie in: its clock started between
    the send and the engine's add() (how long that took is the machine's, not the rule's)."""
    [(_, kw)] = _added_params(path, body, headers)
    deadline = kw["deadline"]
    return None if deadline is None else (deadline - kw["queued"], deadline - kw["sent"])


def _within(window: tuple[float, float] | None, timeout: float) -> bool:
    return window is not None and window[0] - 1e-6 <= timeout <= window[1] + 1e-6


V2_ONE = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                      "data": ["a"]}], "parameters": {"max_tokens": 2}}
MESSAGES = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
CHAT_ONE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body", [(CHAT, CHAT_ONE), (CMPL, {"prompt": "a"}),
                                        (V2, V2_ONE), ("/v1/messages", MESSAGES),
                                        ("/v1/responses", {"input": "hi"})])
def test_the_deadline_reaches_the_engine_from_every_route(path: str, body: dict[str, Any]):
    assert _within(_deadline_of(path, body, {"x-request-timeout": "30"}), 30)
    assert _deadline_of(path, body, {}) is None


def test_the_earliest_deadline_wins_and_a_client_cannot_forge_one():
    assert _within(_deadline_of(CMPL, {"prompt": "a", "timeout": 5},
                                {"x-request-timeout": "30"}), 5)
    params = {**V2_ONE["parameters"], "timeout": 4_000_000}  # microseconds (Triton's)
    assert _within(_deadline_of(V2, {**V2_ONE, "parameters": params},
                                {"x-request-timeout": "30"}), 4)
    # The middleware's header to KServe's routes: a client's own copy never arrives.
    assert _deadline_of(V2, V2_ONE, {DEADLINE_HEADER: "1.0"}) is None
    assert _within(_deadline_of(V2, V2_ONE, {DEADLINE_HEADER: "1.0",
                                             "x-request-timeout": "30"}), 30)


@pytest.mark.parametrize("value", ["1e308", "0", "nan", "inf", "12.5;not-the-seal", "x;y"])
def test_a_deadline_header_the_middleware_did_not_write_is_not_read(value: str):
    """gRPC metadata reaches predict's headers without the middleware: a client's value there
    is ignored; the middleware's sealed one is read, and only a finite one."""
    assert headers_deadline({DEADLINE_HEADER: value}) is None
    assert headers_deadline({DEADLINE_HEADER: sealed_deadline(12.5)}) == 12.5
    assert headers_deadline({DEADLINE_HEADER: sealed_deadline(float("nan"))}) is None


@pytest.mark.parametrize("wire, param", [({"temperature": -1}, "temperature"),
                                         ({"top_p": 7}, "top_p"), ({"n": 0}, "n")])
def test_a_value_out_of_range_is_refused_before_any_prompt_is_read(wire: dict, param: str):
    """The ranges are the engine's (SamplingParams), checked when the options are read, so a
    bad value costs no template rendering or tokenizing."""
    with pytest.raises(OptionError) as caught:
        SamplingRequest.of(wire)
    assert caught.value.param == param
