"""Issue 49: per-request cost bounded before admission. Each capped list (allowed_token_ids,
bad_words, stop, stop_token_ids), a prompt of token ids and the prompts of one request are
refused over the server's flag with a 400 naming it, before the list is read; the prompts of
one request share one SamplingParams' lists (kserve_paged/request_caps.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kserve_paged import args as server_args
from kserve_paged.request_caps import (
    RequestCaps,
    caps_from_args,
    check_prompt_count,
    request_caps,
    set_request_caps,
)
from kserve_paged.request_options import OptionError, SamplingRequest
from kserve_paged_engine import limits as L
from kserve_paged_engine.sampling_params import SamplingParams
from tests.helpers.server import NAME, V2_BODY, client, ready, run

CAP = 4


@pytest.fixture
def small_caps() -> Iterator[RequestCaps]:
    before = request_caps()
    caps = RequestCaps(max_allowed_token_ids=CAP, max_bad_words=CAP, max_stop=CAP,
                       max_prompts=CAP, max_prompt_token_ids=CAP)
    set_request_caps(caps)
    yield caps
    set_request_caps(before)


# Entries the coercion would refuse on its own: a refusal naming the flag shows that the cap
# was checked before any entry was read.
UNREADABLE = ["not an id"] * (CAP + 1)


@pytest.mark.parametrize("option, value, flag", [
    ("allowed_token_ids", UNREADABLE, "--max_allowed_token_ids"),
    ("allowed_token_ids", ",".join(["x"] * (CAP + 1)), "--max_allowed_token_ids"),  # v2's form
    ("stop_token_ids", UNREADABLE, "--max_stop"),
    ("bad_words", [None] * (CAP + 1), "--max_bad_words"),
    ("stop", [None] * (CAP + 1), "--max_stop"),
])
def test_a_list_over_its_cap_is_refused_before_it_is_read(small_caps, option, value, flag):
    with pytest.raises(OptionError) as err:
        SamplingRequest.of({option: value})
    assert err.value.param == option
    assert f"{option} has {CAP + 1} entries" in str(err.value) and f"{flag} {CAP}" in str(
        err.value)


def test_lists_at_their_caps_are_taken(small_caps):
    request = SamplingRequest.of({"allowed_token_ids": list(range(CAP)), "stop": ["a"] * CAP,
                                  "bad_words": ["b"] * CAP, "stop_token_ids": "1,2,3,4"})
    params = request.params(prompt_len=1, max_model_len=64)
    assert params.allowed_token_ids == [0, 1, 2, 3] and params.stop_token_ids == [1, 2, 3, 4]


def test_the_caps_are_flags_whose_defaults_are_the_limits():
    args = server_args.parse_args([])
    assert caps_from_args(args) == RequestCaps(
        None, L.DEFAULT_MAX_BAD_WORDS, L.DEFAULT_MAX_STOP, L.DEFAULT_MAX_PROMPTS, None)
    args = server_args.parse_args(["--max_allowed_token_ids", "7", "--max_bad_words=8",
                                   "--max-stop", "9", "--max_prompts", "10",
                                   "--max_prompt_token_ids", "11"])
    assert caps_from_args(args) == RequestCaps(7, 8, 9, 10, 11)
    with pytest.raises(SystemExit):
        server_args.parse_args(["--max_stop", "0"])


@pytest.mark.parametrize("cap", dataclasses.fields(RequestCaps), ids=lambda f: f.name)
def test_every_cap_in_the_table_is_a_flag(cap):
    """Each RequestCaps entry is the flag of its name, in both spellings (--max_stop and
    vLLM's --max-stop), and the parsed value is the cap in force (the defaults are pinned to
    the limits above)."""
    parser = server_args.build_parser()
    [action] = [a for a in parser._actions if a.dest == cap.name]
    assert f"--{cap.name}" in action.option_strings
    for spelling in (f"--{cap.name}", f"--{cap.name.replace('_', '-')}"):
        args = server_args.parse_args([spelling, "3"])
        assert getattr(caps_from_args(args), cap.name) == 3
    with pytest.raises(SystemExit):
        server_args.parse_args([f"--{cap.name}", "0"])


def test_allowed_token_ids_are_capped_at_the_vocabulary_by_default():
    SamplingRequest.of({"allowed_token_ids": [1] * 50}, vocab_size=50)
    with pytest.raises(OptionError, match="--max_allowed_token_ids 50"):
        SamplingRequest.of({"allowed_token_ids": ["x"] * 51}, vocab_size=50)
    with pytest.raises(OptionError, match=f"--max_allowed_token_ids {L.DEFAULT_MAX_ALLOWED_TOKEN_IDS}"):
        SamplingRequest.of({"allowed_token_ids": [1] * (L.DEFAULT_MAX_ALLOWED_TOKEN_IDS + 1)})


def test_bad_words_are_bounded_in_characters_too():
    SamplingParams(bad_words=["a" * L.MAX_BAD_WORDS_CHARS])
    with pytest.raises(ValueError, match="bad_words hold"):
        SamplingParams(bad_words=["a" * L.MAX_BAD_WORDS_CHARS, "b"])


def test_the_prompt_count_is_refused_over_max_prompts(small_caps):
    check_prompt_count(CAP)
    with pytest.raises(OptionError, match=f"--max_prompts {CAP}") as err:
        check_prompt_count(CAP + 1)
    assert err.value.param == "prompt"


def test_the_prompts_of_one_request_share_one_params_lists():
    request = SamplingRequest.of({"allowed_token_ids": [1, 2, 3], "bad_words": ["w"],
                                  "stop": ["s"]}, default_max_tokens=8)
    a = request.params(prompt_len=2, max_model_len=64)
    b = request.params(prompt_len=60, max_model_len=64)
    assert (a.max_tokens, b.max_tokens) == (8, 4)  # each prompt's own budget
    assert a.shared is b.shared and a.allowed_token_ids is b.allowed_token_ids
    with pytest.raises(OptionError, match="min_tokens"):  # each budget is still checked
        SamplingRequest.of({"min_tokens": 5}).params(prompt_len=62, max_model_len=64)


# -- through the server (a fake engine): a 400 naming the flag, the engine never asked --------

def test_a_token_id_prompt_over_the_cap_is_400_before_its_ids_are_read(small_caps):
    async def main() -> None:
        app, model, engine = await ready()
        # the ids are out of any vocabulary: read, they would be refused for that instead
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "max_tokens": 1, "prompt": [10 ** 9] * (CAP + 1)})
            ok = await c.post("/openai/v1/completions", json={
                "model": NAME, "max_tokens": 1, "prompt": [1] * CAP})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and f"--max_prompt_token_ids {CAP}" in err["message"]
        assert ok.status_code == 200, ok.text
        assert len(engine.added) == 1
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("prompt", [[1] * (CAP + 1) + ["not an id"],
                                    [[1, 2], [1] * (CAP + 1) + [None]]],
                         ids=["one", "second of two"])
def test_a_token_id_prompt_over_the_cap_is_refused_before_validation_walks_it(small_caps,
                                                                              prompt):
    """The body's validation would refuse the tail entry as not an id; the cap's message shows
    that the length was read from the decoded JSON first (pydantic walking millions of ids
    held the server's GIL, issue 49 item 4)."""
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "max_tokens": 1, "prompt": prompt})
        assert r.status_code == 400, r.text
        assert f"--max_prompt_token_ids {CAP}" in r.json()["error"]["message"]
        assert not engine.added
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("route", ["completions", "v2"])
def test_more_prompts_than_max_prompts_is_a_400_before_any_is_tokenized(small_caps, route):
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            if route == "completions":
                r = await c.post("/openai/v1/completions", json={
                    "model": NAME, "max_tokens": 1, "prompt": ["a"] * (CAP + 1)})
                message = r.json()["error"]["message"]
            else:
                inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [CAP + 1],
                           "data": ["a"] * (CAP + 1)}]
                r = await c.post(f"/v2/models/{NAME}/infer", json={
                    "inputs": inputs, "parameters": {"max_tokens": 1}})
                message = r.json()["error"]
        assert r.status_code == 400, r.text
        assert f"--max_prompts {CAP}" in message
        assert engine.added == []
        model.stop_engine()
    run(main())


def test_token_id_prompts_are_capped_at_the_context_window_by_default():
    async def main() -> None:
        app, model, engine = await ready()
        window = model.info.max_model_len
        async with client(app) as c:
            r = await c.post("/openai/v1/completions", json={
                "model": NAME, "max_tokens": 1, "prompt": [10 ** 9] * (window + 1)})
        assert r.status_code == 400, r.text
        assert f"--max_prompt_token_ids {window}" in r.json()["error"]["message"]
        assert engine.added == []
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("path, body", [
    ("/openai/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 1,
                                "allowed_token_ids": list(range(CAP + 1))}),
    ("/openai/v1/chat/completions", {"model": NAME, "max_tokens": 1,
                                     "messages": [{"role": "user", "content": "a"}],
                                     "bad_words": ["w"] * (CAP + 1)}),
    (f"/v2/models/{NAME}/infer", {**V2_BODY, "parameters": {
        "stop_token_ids": ",".join(["1"] * (CAP + 1))}}),
])
def test_every_route_refuses_a_list_over_its_cap(small_caps, path, body):
    async def main() -> None:
        app, model, engine = await ready()
        async with client(app) as c:
            r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "more than this server takes" in r.text and f" {CAP}); " in r.text
        assert engine.added == []
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("prompt, prompts", [
    ([], [[]]), ("a", ["a"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]])])
def test_a_completions_prompt_splits_into_its_prompts(prompt, prompts):
    """An empty list is one empty prompt (refused by the prompt check), never zero prompts:
    the body's union takes token ids first, and [] is a list of token ids too."""
    from kserve_paged.openai.completions import split_prompts
    from kserve_paged.openai.schemas import CompletionBody

    assert split_prompts(CompletionBody(model=NAME, prompt=prompt).prompt) == prompts
