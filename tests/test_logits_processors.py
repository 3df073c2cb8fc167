"""Penalties and logit bias change the logits exactly as specified; logprob bookkeeping."""

import pytest
import torch

from kserve_paged_engine.sample.logits_processors import apply_penalties, top_logprobs
from kserve_paged_engine.sampling_params import SamplingParams

V = 8


def run(params, prompt, output, logits=None):
    logits = logits if logits is not None else torch.tensor(
        [[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5]])
    return apply_penalties(logits, [params], [prompt], [output])[0], logits[0]


def test_rows_without_penalties_are_returned_untouched():
    logits = torch.randn(3, V)
    out = apply_penalties(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3)
    assert out is logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    out, raw = run(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[6, 6])
    expected = raw.clone()
    expected[0] = 2.0 / 2  # positive, seen in the prompt
    expected[1] = -1.0 * 2  # negative, seen in the prompt
    expected[6] = 4.0 / 2  # positive, seen in the output (once, however often)
    assert torch.equal(out, expected)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out, raw = run(p, prompt=[0, 2], output=[4, 4, 4, 7])
    expected = raw.clone()
    expected[4] -= 0.5 * 3 + 0.25
    expected[7] -= 0.5 * 1 + 0.25
    assert torch.allclose(out, expected)
    assert out[0] == raw[0] and out[2] == raw[2]  # prompt tokens are not counted


def test_negative_presence_penalty_encourages_repeats():
    out, raw = run(SamplingParams(presence_penalty=-1.0), prompt=[0], output=[3])
    assert out[3] == raw[3] + 1.0


def test_logit_bias_adds_to_listed_tokens_and_ignores_ids_past_the_vocabulary():
    out, raw = run(SamplingParams(logit_bias={"5": 100, 1: -100, 10**6: 5}), [0], [])
    expected = raw.clone()
    expected[5] += 100
    expected[1] -= 100
    assert torch.equal(out, expected)


def test_penalties_apply_per_row():
    logits = torch.ones(2, V)
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    out = apply_penalties(logits, params, [[0], [0]], [[3], [3]])
    assert out[0, 3] == 0.0 and out[1, 3] == 1.0
    assert torch.equal(logits, torch.ones(2, V))  # the input is not modified


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0.0},
    {"repetition_penalty": float("inf")}, {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}},
    {"logit_bias": {"x": 1}}, {"logprobs": 21}, {"logprobs": -1},
])
def test_out_of_range_options_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_top_logprobs_are_log_softmax_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    chosen, tops, ranks = top_logprobs(logits, torch.tensor([2]), 2)
    lp = torch.log_softmax(logits, -1)[0]
    assert chosen[0] == pytest.approx(lp[2].item())
    assert ranks == [2]
    assert [t for t, _ in tops[0]] == [1, 2]
    assert tops[0][0][1] == pytest.approx(lp[1].item())
