"""Request options (issue 9) end to end: the OpenAI and Triton clients against the real server
process, each option's result compared with the offline ``LLM`` given the same options.

Requests are short (CPU budget); greedy ones must match the reference token for token, log-
probabilities to within float noise (the server batches differently).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kserve_paged_engine import SamplingParams
from tests.helpers.e2e_server import MODEL, Server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 2e-3


@pytest.fixture(scope="module")
def oai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused", timeout=120,
                         max_retries=0)


def greedy(offline_llm, prompt: Any, **options: Any):
    return offline_llm.generate(prompt, SamplingParams(temperature=0, **options),
                                use_tqdm=False)[0]


def test_n_greedy_gives_identical_choices(oai, offline_llm):
    want = greedy(offline_llm, PROMPT, max_tokens=6).outputs[0].text
    r = oai.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want] * 4
    assert r.usage.completion_tokens == 4 * 6

    texts = {i: "" for i in range(4)}
    finished = []
    for chunk in oai.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=6,
                                        temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
    assert texts == {i: want for i in range(4)} and sorted(finished) == [0, 1, 2, 3]

    chat_want = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5),
                                 use_tqdm=False)[0].outputs[0].text
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=5,
                                    temperature=0)
    assert [(c.index, c.message.content) for c in r.choices] == [(i, chat_want)
                                                                 for i in range(3)]
    streamed = {i: "" for i in range(3)}
    for chunk in oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=5,
                                             temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {i: chat_want for i in range(3)}


def test_completions_logprobs_and_echo(oai, offline_llm):
    want = greedy(offline_llm, PROMPT, max_tokens=5, logprobs=3, prompt_logprobs=3)
    out = want.outputs[0]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                               logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [entry[t].decoded_token for t, entry in zip(out.token_ids, out.logprobs)]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in
                                               zip(out.token_ids, out.logprobs)], abs=TOL)
    for top, entry in zip(lp.top_logprobs, out.logprobs):
        assert len(top) <= 4  # the top 3 and the chosen token
        assert top == pytest.approx({e.decoded_token: e.logprob for e in entry.values()},
                                    abs=TOL)

    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                               logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT + out.text
    n = len(want.prompt_token_ids)
    assert len(choice.logprobs.tokens) == n + len(out.token_ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:n] == pytest.approx(
        [e[t].logprob for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])],
        abs=TOL)


def test_chat_logprobs(oai, offline_llm):
    ids = offline_llm.apply_chat_template(CHAT)
    out = greedy(offline_llm, ids, max_tokens=5, logprobs=2).outputs[0]
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [e[t].decoded_token for t, e in
                                          zip(out.token_ids, out.logprobs)]
    for item, t, entry in zip(content, out.token_ids, out.logprobs):
        assert item.logprob == pytest.approx(entry[t].logprob, abs=TOL)
        assert bytes(item.bytes).decode() == item.token
        assert [x.token for x in item.top_logprobs] == [
            e.decoded_token for e in sorted(entry.values(), key=lambda e: e.rank) if e.rank <= 2]
    tokens = [c.token for chunk in oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        stream=True) for choice in chunk.choices if choice.logprobs
        for c in choice.logprobs.content]
    assert tokens == [c.token for c in content]


def test_penalties_logit_bias_and_seed(oai, offline_llm):
    tok = offline_llm.get_tokenizer()
    for options in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        want = greedy(offline_llm, PROMPT, max_tokens=12, **options).outputs[0].text
        r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                   **options)
        assert r.choices[0].text == want
        assert want != greedy(offline_llm, PROMPT, max_tokens=12).outputs[0].text
    want = greedy(offline_llm, PROMPT, max_tokens=12, repetition_penalty=1.8).outputs[0].text
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                               extra_body={"repetition_penalty": 1.8})
    assert r.choices[0].text == want

    forced = tok.encode(" banana")[0]
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert r.choices[0].message.content == tok.decode([forced] * 3)

    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0)
    first = oai.completions.create(seed=7, **kwargs).choices[0].text
    assert oai.completions.create(seed=7, **kwargs).choices[0].text == first
    assert oai.completions.create(seed=8, **kwargs).choices[0].text != first


def test_max_completion_tokens_and_stop_options(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                  temperature=0).choices[0].text
    stop = full.strip().split()[0][-2:]
    kept = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("call,param", [
    (lambda c: c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=1, best_of=2),
     "best_of"),
    (lambda c: c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="x"),
     "suffix"),
    (lambda c: c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objet"}}}),
     "response_format"),
    (lambda c: c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2,
        tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                         top_logprobs=3), "top_logprobs"),
])
def test_unsupported_options_are_400s_naming_them(oai, call, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        call(oai)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and param in body["message"]


def test_v2_n_and_logprobs_through_tritonclient(server: Server, offline_llm):
    import tritonclient.http as httpclient

    want = greedy(offline_llm, PROMPT, max_tokens=4, logprobs=1).outputs[0]
    client = httpclient.InferenceServerClient(server.http_host, network_timeout=120)
    tensor = httpclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    outputs = [httpclient.InferRequestedOutput("text_output", binary_data=True),
               httpclient.InferRequestedOutput("logprobs", binary_data=False)]
    result = client.infer(MODEL, [tensor], outputs=outputs, parameters={
        "max_tokens": 4, "temperature": 0.0, "n": 3, "logprobs": 1})
    texts = result.as_numpy("text_output")
    assert texts.shape == (1, 3) and [t.decode() for t in texts[0]] == [want.text] * 3
    logprobs = result.as_numpy("logprobs")
    assert logprobs.shape == (1, 3)
    for raw in logprobs[0]:
        tokens = json.loads(raw)
        assert [t["token_id"] for t in tokens] == want.token_ids
        assert [t["logprob"] for t in tokens] == pytest.approx(
            [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=TOL)


GRPC_CLIENT = """
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient

host, model, prompt = sys.argv[1:4]
client = grpcclient.InferenceServerClient(host)
tensor = grpcclient.InferInput("text_input", [1], "BYTES")
tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
result = client.infer(model, [tensor], client_timeout=120, parameters={
    "max_tokens": 4, "temperature": 0.0, "n": 2, "logprobs": 0, "presence_penalty": 0.5})
texts = result.as_numpy("text_output")
print(json.dumps({"shape": list(texts.shape), "texts": [t.decode() for t in texts.reshape(-1)],
                  "logprobs": [json.loads(v) for v in result.as_numpy("logprobs").reshape(-1)]}))
"""


def test_v2_options_over_grpc(server: Server, offline_llm):
    """In a subprocess: tritonclient.grpc's protos clash with KServe's in one process; the
    float parameter travels as gRPC double_param (see model.v2_parameters)."""
    want = greedy(offline_llm, PROMPT, max_tokens=4, presence_penalty=0.5).outputs[0]
    proc = subprocess.run([sys.executable, "-c", GRPC_CLIENT, server.grpc_host, MODEL, PROMPT],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == [1, 2] and result["texts"] == [want.text] * 2
    assert [[t["token_id"] for t in sample] for sample in result["logprobs"]] == [
        want.token_ids] * 2
