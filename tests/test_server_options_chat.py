"""Request options through the server's routes, in process, on the real default model (see
test_server_options.py): chat, refusals, v2 and v1, beam search."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kserve_paged_engine import SamplingParams
from tests.helpers.served_options import (
    CHAT,
    CHAT_URL,
    CMPL,
    PROMPTS,
    TOL,
    V2,
    call,
    chat_ids,
    ok,
    refused,
)
from tests.helpers.server import NAME

# Fixtures `served` and `ref` (one served engine, its offline reference): tests/conftest.py.

# -- chat ----------------------------------------------------------------------------------------

def test_chat_logprobs_n_and_streaming(served, ref):
    want = ref.generate(chat_ids(ref), SamplingParams(max_tokens=4, temperature=0, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": True,
            "top_logprobs": 2}
    result = ok(served, CHAT_URL, body)
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for choice in result["choices"]:
        assert choice["message"]["content"] == want.text
        content = choice["logprobs"]["content"]
        assert len(content) == len(want.token_ids)
        for item, tid, entry in zip(content, want.token_ids, want.logprobs):
            assert item["token"] == entry[tid].decoded_token
            assert item["logprob"] == pytest.approx(entry[tid].logprob, abs=TOL)
            assert bytes(item["bytes"]).decode() == item["token"]
            tops = sorted((lp for lp in entry.values() if lp.rank <= 2), key=lambda lp: lp.rank)
            assert [t["token"] for t in item["top_logprobs"]] == [lp.decoded_token for lp in tops]
    assert result["usage"]["completion_tokens"] == 2 * len(want.token_ids)

    chunks = ok(served, CHAT_URL, {**body, "stream": True})
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == want.text
        streamed = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert [t["token"] for t in streamed] == [t["token"] for t in
                                                  result["choices"][i]["logprobs"]["content"]]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]

    # logprobs without top_logprobs: the chosen tokens only
    plain = ok(served, CHAT_URL, {"messages": CHAT, "max_tokens": 2, "temperature": 0,
                                  "logprobs": True})["choices"][0]["logprobs"]["content"]
    assert len(plain) == 2 and all(item["top_logprobs"] == [] for item in plain)
    none = ok(served, CHAT_URL, {"messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert none["choices"][0]["logprobs"] is None


def test_chat_max_completion_tokens(served):
    body = {"messages": CHAT, "temperature": 0, "ignore_eos": True}
    result = ok(served, CHAT_URL, {**body, "max_completion_tokens": 3})
    assert result["usage"]["completion_tokens"] == 3
    assert result["choices"][0]["finish_reason"] == "length"
    same = ok(served, CHAT_URL, {**body, "max_completion_tokens": 3, "max_tokens": 3})
    assert same["usage"]["completion_tokens"] == 3
    refused(served, CHAT_URL, {**body, "max_completion_tokens": 3, "max_tokens": 5},
            "max_completion_tokens")


# -- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,extra,param", [
    (CMPL, {"best_of": 2}, "best_of"),
    (CMPL, {"best_of": 3, "n": 2}, "best_of"),
    (CMPL, {"suffix": "end"}, "suffix"),
    (CMPL, {"logprobs": 21}, "logprobs"),
    (CMPL, {"n": 129}, "n"),
    (CMPL, {"guided_json": {"type": "strin"}}, "guided_json"),
    (CMPL, {"guided_regex": "(a"}, "guided_regex"),
    (CMPL, {"guided_choice": "yes"}, "guided_choice"),
    (CMPL, {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    (CMPL, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (CMPL, {"response_format": {"type": "yaml"}}, "response_format"),
    (CMPL, {"guided_decoding_backend": "outlines", "guided_regex": "a"},
     "guided_decoding_backend"),
    (CMPL, {"use_beam_search": True, "stream": True}, "stream"),
    (CMPL, {"use_beam_search": True, "n": 4, "best_of": 2}, "best_of"),
    (CMPL, {"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    (CMPL, {"length_penalty": 0.5}, "length_penalty"),
    (CHAT_URL, {"use_beam_search": True, "stream": True}, "stream"),
    (CMPL, {"logit_bias": {"99999999": 1}}, "logit_bias"),
    (CMPL, {"logit_bias": {"5": 150}}, "logit_bias"),
    (CMPL, {"presence_penalty": -3}, "presence_penalty"),
    (CMPL, {"prompt_logprobs": 50}, "prompt_logprobs"),
    (CHAT_URL, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": 5}}}}, "response_format"),
    (CHAT_URL, {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
    (CHAT_URL, {"tool_choice": "required"}, "tool_choice"),
    (CHAT_URL, {"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT_URL, {"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    (CHAT_URL, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT_URL, {"logprobs": True, "top_logprobs": 21}, "logprobs"),
    (CHAT_URL, {"best_of": 2}, "best_of"),
    (CHAT_URL, {"echo": True}, "echo"),
    (CHAT_URL, {"modalities": ["text", "audio"]}, "modalities"),
])
def test_unsupported_or_invalid_options_are_400s_naming_them(served, path, extra, param):
    body: dict[str, Any] = ({"prompt": "Hi"} if path == CMPL else {"messages": CHAT})
    refused(served, path, {**body, "max_tokens": 2, **extra}, param)


def test_harmless_values_are_accepted(served):
    ok(served, CMPL, {"prompt": "Hi", "max_tokens": 1, "best_of": 2, "n": 2, "echo": False,
                      "suffix": "", "logit_bias": {}, "response_format": {"type": "text"},
                      "use_beam_search": False})
    ok(served, CHAT_URL, {"messages": CHAT, "max_tokens": 1, "tools": [], "tool_choice": "none",
                          "modalities": ["text"], "logprobs": False})


# -- v2 and v1 -----------------------------------------------------------------------------------

def test_v2_parameters_n_logprobs_and_prompt_logprobs(served, ref):
    want = ref.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                prompt_logprobs=1), use_tqdm=False)
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2],
                        "data": PROMPTS}],
            "parameters": {"n": 2, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                           "prompt_logprobs": 1}}
    outputs = {o["name"]: o for o in ok(served, V2, body)["outputs"]}
    text = outputs["text_output"]
    assert text["shape"] == [2, 2]
    assert text["data"] == [w.outputs[0].text for w in want for _ in range(2)]
    assert outputs["logprobs"]["shape"] == [2, 2]
    for i, raw in enumerate(outputs["logprobs"]["data"]):
        c = want[i // 2].outputs[0]
        tokens = json.loads(raw)
        assert [t["token_id"] for t in tokens] == c.token_ids
        for t, entry in zip(tokens, c.logprobs):
            assert t["logprob"] == pytest.approx(entry[t["token_id"]].logprob, abs=TOL)
            assert [x["token_id"] for x in t["top_logprobs"]] == [
                tid for tid, lp in sorted(entry.items(), key=lambda e: e[1].rank)
                if lp.rank <= 2]
    assert outputs["prompt_logprobs"]["shape"] == [2]
    for raw, w in zip(outputs["prompt_logprobs"]["data"], want):
        tokens = json.loads(raw)
        assert tokens[0] is None
        assert [t["token_id"] for t in tokens[1:]] == w.prompt_token_ids[1:]

    # one sample, no logprobs: the layout of before (shape [N], text_output only)
    plain = ok(served, V2, {**body, "parameters": {"max_tokens": 3, "temperature": 0,
                                                   "logit_bias": "{}"}})
    assert [o["name"] for o in plain["outputs"]] == ["text_output"]
    assert plain["outputs"][0]["shape"] == [2]

    # v1: nested predictions for n > 1, logprobs as JSON
    v1 = ok(served, f"/v1/models/{NAME}:predict", {
        "instances": PROMPTS[:1], "parameters": {"n": 2, "max_tokens": 3, "temperature": 0,
                                                 "logprobs": 0}})
    assert v1["predictions"] == [[want[0].outputs[0].text] * 2]
    assert [t["token_id"] for t in v1["logprobs"][0][1]] == want[0].outputs[0].token_ids


def test_v2_logit_bias_string_and_refusals(served, ref):
    tok = ref.get_tokenizer()
    forced = tok.encode(" banana")[0]
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}]
    result = ok(served, V2, {"inputs": inputs, "parameters": {
        "max_tokens": 2, "temperature": 0, "logit_bias": json.dumps({str(forced): 100})}})
    assert result["outputs"][0]["data"] == [tok.decode([forced] * 2)]
    for parameters, needle in (({"best_of": 3, "n": 2}, "best_of"), ({"echo": True}, "echo"),
                               ({"logit_bias": "nope"}, "logit_bias"),
                               ({"n": 0}, "n must be")):
        r = call(served, V2, {"inputs": inputs, "parameters": {"max_tokens": 2, **parameters}})
        assert r.status_code == 400 and needle in r.json()["error"], r.text


def test_beam_search_through_the_routes_equals_the_offline_llm(served, ref):
    want = ref.beam_search(PROMPTS[0], 4, 5)[0].outputs
    body = ok(served, CMPL, {"prompt": PROMPTS[0], "max_tokens": 5, "use_beam_search": True,
                             "n": 2, "best_of": 4})
    assert [c["text"] for c in body["choices"]] == [c.text for c in want[:2]]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    v2 = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                      "data": [PROMPTS[0]]}], "parameters": {"beam_width": 4, "max_tokens": 5}}
    outputs = {o["name"]: o for o in ok(served, V2, v2)["outputs"]}
    assert outputs["text_output"]["data"] == [want[0].text]
    chat = ok(served, CHAT_URL, {"messages": CHAT, "max_tokens": 4, "use_beam_search": True,
                                 "n": 3})
    assert len(chat["choices"]) == 3 and len({c["message"]["content"]
                                               for c in chat["choices"]}) == 3
