"""vLLM's token filters and prompt cut in the engine (allowed_token_ids, bad_words,
truncate_prompt_tokens), a structured-output constraint that waits for the end of thinking,
and --generation_config's defaults: on the logits directly, then through the offline engine
on the tiny thinking model (its greedy output is a fixed chain of words)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kserve_paged.generation_defaults import generation_defaults
from kserve_paged.request_options import OptionError
from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_engine.sample.logits_processors import apply_penalties
from kserve_paged_engine.sample.token_filters import bad_words_token_ids
from tests.helpers.options import make_sampling_params
from tests.helpers.thinking_model import VOCAB, write_thinking_model

ID = {w: i for i, w in enumerate(VOCAB)}
# The chat template's generation prompt with thinking on: greedy goes
# <think> The user asks </think> Paris. <|im_end|>
PROMPT = "<|im_start|> user Capital of France? <|im_end|> <|im_start|> assistant"


def test_allowed_token_ids_leave_only_those_tokens():
    logits = torch.zeros(2, 10)
    out = apply_penalties(logits, [SamplingParams(allowed_token_ids=[3, 7]), SamplingParams()],
                          [[1], [1]], [[], []])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(out[1], logits[1])  # a row without filters is untouched


def test_bad_words_ban_the_last_token_after_the_rest():
    p = SamplingParams(bad_words=["x"])
    p.bad_words_token_ids = [[4], [5, 6]]
    row = apply_penalties(torch.zeros(1, 10), [p], [[1]], [[2, 5]])[0]
    assert row[4] == float("-inf") and row[6] == float("-inf")  # one-token word; after 5
    row = apply_penalties(torch.zeros(1, 10), [p], [[1]], [[5, 2]])[0]
    assert row[4] == float("-inf") and row[6] == 0  # 6 is fine when 5 is not the last token


def test_bad_words_token_ids_as_vllm_finds_them():
    class Tok:  # "a" alone and " a" mid-text are different tokens; "b c" is two either way
        def encode(self, text, add_special_tokens=False):
            return {"a": [1], " a": [2], "b c": [3, 4], " b c": [3, 4]}[text]
    assert bad_words_token_ids(["a", " b c"], Tok()) == [[1], [2], [3, 4]]


@pytest.mark.parametrize("options, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [-1]}, "non-negative"),
    ({"bad_words": [" "]}, "bad_words must be non-empty"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1"),
])
def test_bad_filter_values_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_front_end_counts_the_cut_prompt_and_names_the_option():
    params = make_sampling_params({"truncate_prompt_tokens": 4, "max_tokens": 10},
                                  prompt_len=100, max_model_len=16, default_max_tokens=None)
    assert params.truncate_prompt_tokens == 4 and params.max_tokens == 10
    with pytest.raises(OptionError) as err:
        make_sampling_params({"bad_words": 3}, prompt_len=1, max_model_len=16,
                             default_max_tokens=None)
    assert err.value.param == "bad_words"


def test_generation_defaults_read_vllm_fields(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 30,
         "do_sample": True, "eos_token_id": 2}))
    defaults = generation_defaults(str(tmp_path))
    # max_new_tokens is a default budget, never taken for the client's max_tokens
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert defaults.default_max_tokens == 30
    for none in (generation_defaults(str(tmp_path / "absent")), generation_defaults(None)):
        assert (dict(none.values), none.default_max_tokens) == ({}, None)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = write_thinking_model(tmp_path_factory.mktemp("think"))
    return LLM(model=str(folder), max_model_len=64, num_kv_blocks=16)


def _run(llm: LLM, **options) -> tuple[str, list[int], list[int]]:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, **options),
                       use_tqdm=False)[0]
    return out.outputs[0].text, out.outputs[0].token_ids, out.prompt_token_ids


@pytest.mark.slow  # the engine's start-up (about 10 s on two busy cores)
def test_the_chain_unfiltered(llm):
    text, _, _ = _run(llm)
    assert text.split() == ["<think>", "The", "user", "asks", "</think>", "Paris."]


@pytest.mark.slow  # the engine's start-up (about 10 s on two busy cores)
def test_allowed_token_ids_through_the_engine(llm):
    allowed = [ID["<think>"], ID["The"], ID["<|im_end|>"]]
    _, ids, _ = _run(llm, allowed_token_ids=allowed)
    assert ids and set(ids) <= set(allowed)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        _run(llm, allowed_token_ids=[len(VOCAB) + 5])


@pytest.mark.slow  # the engine's start-up (about 10 s on two busy cores)
def test_bad_words_through_the_engine(llm):
    text, _, _ = _run(llm, bad_words=["Paris."])
    assert "Paris." not in text and "</think>" in text
    text, _, _ = _run(llm, bad_words=["user asks"])  # two tokens: asks never follows user
    assert "user" in text.split() and "user asks" not in text


@pytest.mark.slow  # the engine's start-up (about 10 s on two busy cores)
def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    _, _, full = _run(llm)
    _, _, cut = _run(llm, truncate_prompt_tokens=3)
    assert cut == full[-3:]
    with pytest.raises(ValueError, match="exceeds the context window"):
        _run(llm, truncate_prompt_tokens=65)


@pytest.mark.slow  # the engine's start-up (about 10 s on two busy cores)
def test_a_constraint_waits_for_the_end_of_thinking(llm):
    """A choice the chain never makes: held from the first token it replaces the thinking;
    started after </think> the thinking is free and the answer is the choice."""
    forced = {"choice": ["France?"]}
    text, _, _ = _run(llm, structured_outputs=forced)
    assert text.split() == ["France?"]
    text, _, _ = _run(llm, structured_outputs={**forced,
                                               "start_after_token_id": ID["</think>"]})
    assert text.split() == ["<think>", "The", "user", "asks", "</think>", "France?"]
