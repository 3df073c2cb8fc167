"""Request options without a model: parsing them into SamplingParams (naming the bad one),
the table of options the engine cannot honour, and rendering logprobs in each protocol's shape."""

from __future__ import annotations

from typing import Any

import pytest

from kserve_paged.logprobs import (
    VERY_UNLIKELY,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from kserve_paged.request_options import OptionError, SamplingRequest, unsupported_options
from kserve_paged.v2 import V2_UNSUPPORTED_OPTIONS
from kserve_paged_engine.outputs import Logprob
from tests.helpers.options import make_sampling_params

# -- option parsing and rendering (no model) -----------------------------------------------------

def test_options_parse_and_name_the_bad_one():
    opts = SamplingRequest.of({"n": "3", "presence_penalty": "0.5", "logit_bias": '{"7": -100}',
                              "skip_special_tokens": "false", "logprobs": 2,
                              "include_stop_str_in_output": True}, vocab_size=10).values
    assert opts == {"n": 3, "presence_penalty": 0.5, "logit_bias": {7: -100.0},
                    "skip_special_tokens": False, "logprobs": 2,
                    "include_stop_str_in_output": True}
    assert SamplingRequest.of({"logit_bias": {"3": 1, 4: 2}}).values["logit_bias"] == {3: 1.0, 4: 2.0}
    for bad in ({"10": 1}, {"-1": 1}, {"x": 1}, {"1": 101}, {"1": "high"}, '{"1":', [1, 2]):
        with pytest.raises(OptionError) as err:
            SamplingRequest.of({"logit_bias": bad}, vocab_size=10)
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


