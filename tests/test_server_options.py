"""Request options (issue 9) through the server's routes, in process, on the real default model.

The app is assembled as in test_server_routes (KServe's routes + ours), but the engine is the
real one, so n, logprobs, echo, penalties, logit_bias and seed are checked against what the
offline ``LLM`` (same engine, same options) returns for the same request. e2e/ repeats the
important ones through the OpenAI and Triton clients against the real server process.
Requests are short: these run on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from kserve_paged.logprobs import (
    TokenText,
)
from kserve_paged_engine import LLM, SamplingParams
from tests.helpers.served_options import (
    CHAT,
    CHAT_URL,
    CMPL,
    PROMPTS,
    TOL,
    chat_ids,
    ok,
)

# Fixtures `served` and `ref` (one served engine, its offline reference): tests/conftest.py.


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


