"""Request options (issue 9) through the server's routes, in process, on the real default model.

The app is assembled as in test_server_routes (KServe's routes + ours), but the engine is the
real one, so n, logprobs, echo, penalties, logit_bias and seed are checked against what the
offline ``LLM`` (same engine, same options) returns for the same request. e2e/ repeats the
important ones through the OpenAI and Triton clients against the real server process.
Requests are short: these run on CPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.default_model import ensure_default_model
from engine.outputs import Logprob
from kserve_paged.logprobs import (
    VERY_UNLIKELY,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from kserve_paged.model import PagedLLMModel
from kserve_paged.sampling import (
    V2_UNSUPPORTED_OPTIONS,
    OptionError,
    make_sampling_params,
    normalize_options,
    unsupported_options,
)
from tests.helpers.server import NAME, build, client, sse

OPTS = {"max_model_len": 256, "num_kv_blocks": 64}
PROMPTS = ["The capital of France is", "1, 2, 3,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CMPL = "/openai/v1/completions"
CHAT_URL = "/openai/v1/chat/completions"
V2 = f"/v2/models/{NAME}/infer"
TOL = 2e-3  # batch composition changes float sums a little between server and reference


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_default_model(progress=lambda _: None))


@pytest.fixture(scope="module")
def served(model_dir: str) -> Iterator[tuple[Any, PagedLLMModel]]:
    from engine.llm_engine import LLMEngine

    app, model = build(engine=LLMEngine(EngineConfig(model=model_dir, **OPTS)))
    asyncio.run(model.start_engine())
    yield app, model
    model.stop_engine()


@pytest.fixture(scope="module")
def ref(model_dir: str) -> LLM:
    return LLM(model=model_dir, **OPTS)


def call(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any]) -> Any:
    """POST ``body``; the httpx response (read)."""
    app, _ = served

    async def main() -> Any:
        async with client(app) as c:
            return await c.post(path, json=body)
    return asyncio.run(asyncio.wait_for(main(), 120))


def ok(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any]) -> Any:
    r = call(served, path, body)
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else sse(r.text)


def refused(served: tuple[Any, PagedLLMModel], path: str, body: dict[str, Any],
            param: str) -> str:
    r = call(served, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error"
    return err["message"]


def chat_ids(ref: LLM) -> list[int]:
    return ref.apply_chat_template(CHAT)


# -- option parsing and rendering (no model) -----------------------------------------------------

def test_options_parse_and_name_the_bad_one():
    opts = normalize_options({"n": "3", "presence_penalty": "0.5", "logit_bias": '{"7": -100}',
                              "skip_special_tokens": "false", "logprobs": 2,
                              "include_stop_str_in_output": True}, vocab_size=10)
    assert opts == {"n": 3, "presence_penalty": 0.5, "logit_bias": {7: -100.0},
                    "skip_special_tokens": False, "logprobs": 2,
                    "include_stop_str_in_output": True}
    assert normalize_options({"logit_bias": {"3": 1, 4: 2}})["logit_bias"] == {3: 1.0, 4: 2.0}
    for bad in ({"10": 1}, {"-1": 1}, {"x": 1}, {"1": 101}, {"1": "high"}, '{"1":', [1, 2]):
        with pytest.raises(OptionError) as err:
            normalize_options({"logit_bias": bad}, vocab_size=10)
        assert err.value.param == "logit_bias"
    # SamplingParams' own checks name their option (prompt_logprobs is not "logprobs")
    for options, param in (({"prompt_logprobs": 21}, "prompt_logprobs"),
                           ({"logprobs": -1}, "logprobs"), ({"n": 0}, "n"),
                           ({"frequency_penalty": 9}, "frequency_penalty"),
                           ({"repetition_penalty": 0}, "repetition_penalty")):
        with pytest.raises(OptionError) as err:
            make_sampling_params(options, prompt_len=1, max_model_len=64, default_max_tokens=4)
        assert err.value.param == param, options
    p = make_sampling_params({"n": 2, "logprobs": 3, "prompt_logprobs": 1, "seed": 5},
                             prompt_len=1, max_model_len=64, default_max_tokens=4)
    assert (p.n, p.logprobs, p.prompt_logprobs, p.seed) == (2, 3, 1, 5)


def test_unsupported_options_table():
    assert unsupported_options({"best_of": 2, "n": 2}) == []
    assert unsupported_options({"best_of": 3, "n": 2}) == ["best_of"]
    assert unsupported_options({"best_of": 2}) == ["best_of"]
    assert unsupported_options({"use_beam_search": False, "guided_json": None,
                                "bad_words": []}) == []
    # Both are served: beam search, and guided decoding (kserve_paged/structured.py).
    assert unsupported_options({"use_beam_search": "true", "guided_regex": "a+"}) == []
    # With beam search best_of is the beam width.
    assert unsupported_options({"best_of": 4, "n": 2, "use_beam_search": True}) == []
    assert unsupported_options({"echo": True, "n": 4, "logprobs": 2},
                               V2_UNSUPPORTED_OPTIONS) == ["echo"]


def test_logprob_rendering():
    class Tok:
        def decode(self, ids: list[int], **_: Any) -> str:
            return "".join(f"<{i}>" for i in ids)

    text = TokenText(Tok())
    entries = [None,
               {5: Logprob(-2.0, 3, "b"), 7: Logprob(-0.5, 1, "a"), 8: Logprob(-1.0, 2, "c")},
               {9: Logprob(float("-inf"), 50000, "z")}]
    legacy, end = completion_logprobs([4, 5, 9], entries, 1, text, offset=10)
    assert legacy == {"tokens": ["<4>", "b", "z"], "text_offset": [10, 13, 14],
                      "token_logprobs": [None, -2.0, VERY_UNLIKELY],
                      "top_logprobs": [None, {"a": -0.5, "b": -2.0}, {"z": VERY_UNLIKELY}]}
    assert end == 15
    chat = chat_logprobs([5], entries[1:2], 2, text)
    assert chat == [{"token": "b", "logprob": -2.0, "bytes": [98], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "c", "logprob": -1.0, "bytes": [99]}]}]
    assert chat_logprobs([5], entries[1:2], 0, text)[0]["top_logprobs"] == []
    assert prompt_logprobs_json(entries[:2])[1]["7"] == {"logprob": -0.5, "rank": 1,
                                                         "decoded_token": "a"}


def test_token_bytes_of_a_split_character(ref: LLM):
    """'日' is two byte-level tokens that each decode to U+FFFD; their bytes join into it."""
    tok = ref.get_tokenizer()
    text = TokenText(tok)
    ids = tok.encode("日本")
    joined = b"".join(bytes(text.bytes(i, tok.decode([i]))) for i in ids)
    assert joined.decode("utf-8") == "日本"
    assert "\ufffd" in tok.decode([ids[0]])


# -- completions ---------------------------------------------------------------------------------

def test_completions_n_greedy_samples_and_indices(served, ref):
    want = [o.outputs[0].text for o in ref.generate(
        PROMPTS, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)]
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 5, "temperature": 0}
    result = ok(served, CMPL, body)
    assert [c["index"] for c in result["choices"]] == list(range(6))
    assert [c["text"] for c in result["choices"]] == [want[0]] * 3 + [want[1]] * 3
    prompt_tokens = sum(len(ref.engine.tokenize(p)) for p in PROMPTS)
    assert result["usage"]["prompt_tokens"] == prompt_tokens  # once per prompt, not per sample
    assert result["usage"]["completion_tokens"] == 6 * 5

    chunks = ok(served, CMPL, {**body, "stream": True,
                               "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            reasons.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: want[i // 3] for i in range(6)}
    assert reasons == {i: ["length"] for i in range(6)}  # exactly one finish per choice
    assert chunks[-1]["usage"]["completion_tokens"] == 30


def _check_legacy(logprobs: dict[str, Any], token_ids: list[int], entries: list[Any],
                  k: int, text: str) -> None:
    """The legacy object against the engine's ids/entries for the same tokens."""
    assert len(logprobs["tokens"]) == len(token_ids)
    for j, (tid, entry) in enumerate(zip(token_ids, entries)):
        if entry is None:
            assert logprobs["token_logprobs"][j] is None and logprobs["top_logprobs"][j] is None
            continue
        assert logprobs["tokens"][j] == entry[tid].decoded_token
        assert logprobs["token_logprobs"][j] == pytest.approx(entry[tid].logprob, abs=TOL)
        top = logprobs["top_logprobs"][j]
        want = {lp.decoded_token: lp.logprob for t, lp in entry.items()
                if lp.rank <= k or t == tid}
        assert top.keys() == want.keys()
        for key, value in want.items():
            assert top[key] == pytest.approx(value, abs=TOL)
    offsets = logprobs["text_offset"]
    for j in range(1, len(offsets)):
        assert offsets[j] - offsets[j - 1] == len(logprobs["tokens"][j - 1])
    assert "".join(logprobs["tokens"]) == text[offsets[0]:]


def test_completions_logprobs_equal_the_engine(served, ref):
    want = ref.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logprobs=3),
                        use_tqdm=False)[0].outputs[0]
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 3}
    (choice,) = ok(served, CMPL, body)["choices"]
    assert choice["text"] == want.text
    _check_legacy(choice["logprobs"], want.token_ids, want.logprobs, 3, choice["text"])
    assert choice["logprobs"]["text_offset"][0] == 0

    # streamed: the chunks' logprobs join into the same object
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for chunk in ok(served, CMPL, {**body, "stream": True}):
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    assert joined["tokens"] == choice["logprobs"]["tokens"]
    assert joined["text_offset"] == choice["logprobs"]["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"],
                                                     abs=TOL)


def test_completions_echo_with_and_without_logprobs(served, ref):
    prompt = PROMPTS[0]
    want = ref.generate(prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                               prompt_logprobs=2), use_tqdm=False)[0]
    out = want.outputs[0]
    (plain,) = ok(served, CMPL, {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                 "echo": True})["choices"]
    assert plain["text"] == prompt + out.text and plain["logprobs"] is None

    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    (choice,) = ok(served, CMPL, body)["choices"]
    assert choice["text"] == prompt + out.text
    lp = choice["logprobs"]
    n_prompt = len(want.prompt_token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    _check_legacy({k: v[:n_prompt] for k, v in lp.items()}, want.prompt_token_ids,
                  want.prompt_logprobs, 2, prompt)
    rest = {k: v[n_prompt:] for k, v in lp.items()}
    assert rest["text_offset"][0] == len(prompt)  # generated tokens: offsets into the text
    _check_legacy(rest, out.token_ids, out.logprobs, 2, choice["text"])

    # streamed echo: the prompt comes first, once per choice
    chunks = ok(served, CMPL, {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                               "echo": True, "n": 2, "stream": True})
    for i in (0, 1):
        pieces = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i]
        assert pieces[0].startswith(prompt) and "".join(pieces) == prompt + out.text


def test_prompt_logprobs_extra(served, ref):
    want = ref.generate(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0,
                                                   prompt_logprobs=1), use_tqdm=False)[0]
    (choice,) = ok(served, CMPL, {"prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0,
                                  "prompt_logprobs": 1})["choices"]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, ref_entry in zip(got[1:], want.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(ref_entry)
        for t, lp in ref_entry.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=TOL)
            assert entry[str(t)]["rank"] == lp.rank

    # chat: at the top of the answer (vLLM's place), and on the first content chunk streamed
    n_prompt = len(chat_ids(ref))
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    whole = ok(served, CHAT_URL, body)["prompt_logprobs"]
    assert len(whole) == n_prompt and whole[0] is None
    chunks = ok(served, CHAT_URL, {**body, "stream": True})
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["delta"].get("content")
    assert [e and sorted(e) for e in carrying[0]["prompt_logprobs"]] == [
        e and sorted(e) for e in whole]


def test_logit_bias_forces_a_token_and_penalties_steer(served, ref):
    tok = ref.get_tokenizer()
    forced = tok.encode(" banana")[0]
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    result = ok(served, CMPL, {**body, "logit_bias": {str(forced): 100}})
    assert result["choices"][0]["text"] == tok.decode([forced] * 4)
    result = ok(served, CMPL, {**body, "logit_bias": {str(forced): -100}, "logprobs": 0})
    assert tok.decode([forced]) not in result["choices"][0]["logprobs"]["tokens"]

    # Greedy "Paris.\n\nThe answer is..." repeats tokens of the prompt; each penalty makes the
    # server answer what the engine answers with it, which is not the plain greedy answer.
    prompt = PROMPTS[0]
    plain = ref.generate(prompt, SamplingParams(max_tokens=12, temperature=0),
                         use_tqdm=False)[0].outputs[0].text
    for options in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0},
                    {"presence_penalty": 2.0}):
        want = ref.generate(prompt, SamplingParams(max_tokens=12, temperature=0, **options),
                            use_tqdm=False)[0].outputs[0].text
        got = ok(served, CMPL, {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                **options})["choices"][0]["text"]
        assert got == want, options
        assert got != plain, options


def test_seed_reproduces_a_sample(served):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    first = ok(served, CMPL, body)["choices"][0]["text"]
    assert ok(served, CMPL, body)["choices"][0]["text"] == first
    other = ok(served, CMPL, {**body, "seed": 4321})["choices"][0]["text"]
    assert other != first
    # n samples of a seeded request: sample i uses seed + i, so they differ and reproduce
    texts = [c["text"] for c in ok(served, CMPL, {**body, "n": 2})["choices"]]
    assert texts[0] == first and texts[1] != first
    assert [c["text"] for c in ok(served, CMPL, {**body, "n": 2})["choices"]] == texts


def test_stop_string_kept_and_special_tokens_shown(served, ref):
    tok = ref.get_tokenizer()
    base = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    full = ok(served, CMPL, base)["choices"][0]["text"]
    stop = full.strip().split()[0][-2:]  # a piece of the greedy text
    cut = ok(served, CMPL, {**base, "stop": [stop]})["choices"][0]
    kept = ok(served, CMPL, {**base, "stop": [stop], "include_stop_str_in_output": True})
    assert cut["finish_reason"] == "stop" and not cut["text"].endswith(stop)
    assert kept["choices"][0]["text"] == cut["text"] + stop

    special = tok.convert_tokens_to_ids("<|im_start|>")
    forced = {**base, "max_tokens": 2, "ignore_eos": True, "logit_bias": {str(special): 100}}
    assert ok(served, CMPL, forced)["choices"][0]["text"] == ""
    shown = ok(served, CMPL, {**forced, "skip_special_tokens": False})["choices"][0]["text"]
    assert shown == "<|im_start|><|im_start|>"


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
