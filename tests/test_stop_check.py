"""The step's stop check (engine/kserve_paged_engine/frontend/stop_check.py) and who owns what
per request: the stop check decides endings before the scheduler hears of the step (which then
only appends and frees), and the sample stage keeps each request's generator and logprobs
until the request ends."""

from __future__ import annotations

import pytest

from kserve_paged_engine.core.request import RequestStatus
from kserve_paged_engine.frontend.stop_check import StopCheck
from tests.helpers.core import make_request, make_scheduler


class _Texts:
    """Stand-in detokenizers: the text ends in "stop!" once `stop_token` is added."""

    def __init__(self, stop_token: int) -> None:
        self.stop_token = stop_token
        self.fed: list[int] = []

    def detokenize(self, request_id, token, ended_by_token, check_stop):
        self.fed.append(token)
        return "stop!" if token == self.stop_token and check_stop else None


def _prefilled(max_tokens: int = 8):
    sched = make_scheduler()
    req = make_request("a", 20, max_tokens=max_tokens, ignore_eos=False)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, StopCheck(sched.max_model_len).check(out, {"a": 7}))
    return sched, req


def test_the_stop_check_decides_a_stop_string_before_the_scheduler_is_told():
    sched, req = _prefilled()
    texts = _Texts(stop_token=9)
    stops = StopCheck(sched.max_model_len, texts)
    out = sched.schedule()
    ends = stops.check(out, {"a": 9})
    # Decided, and nothing changed yet: the scheduler has not been told.
    assert ends["a"].tokens == [9] and ends["a"].status is RequestStatus.FINISHED_STOPPED
    assert ends["a"].stop_reason == "stop!" and texts.fed == [9]
    assert req.status is RequestStatus.RUNNING and req.output_token_ids == [7]
    finished = sched.update_from_output(out, ends)
    assert finished == [req] and req.output_token_ids == [7, 9]
    assert req.stop_reason == "stop!" and "a" not in sched.requests
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_verified_tokens_are_checked_one_by_one_and_cut_at_the_stop():
    """A speculating request's tokens are checked between one another: a stop string on the
    second of three ends it there, and the third is neither fed to the text nor appended."""
    sched, req = _prefilled()
    texts = _Texts(stop_token=11)
    out = sched.schedule()
    out.spec_tokens["a"] = [10, 11, 12]  # three drafts: two kept, then one more token
    ends = StopCheck(sched.max_model_len, texts).check(out, {"a": 10}, {"a": [11, 13]})
    assert ends["a"].tokens == [10, 11] and ends["a"].stop_reason == "stop!"
    assert ends["a"].rejected_drafts == 1 and texts.fed == [10, 11]


@pytest.mark.parametrize(("min_tokens", "tokens", "want"), [
    (0, [2], ([2], RequestStatus.FINISHED_STOPPED, None)),      # EOS
    (3, [2], ([2], None, None)),                                 # EOS under min_tokens
    (0, [7], ([7], RequestStatus.FINISHED_LENGTH, None)),        # max_tokens (2 outputs)
])
def test_token_and_length_rules_without_a_detokenizer(min_tokens, tokens, want):
    sched, req = _prefilled(max_tokens=2 if want[1] else 3)
    req.sampling_params.min_tokens = min_tokens
    out = sched.schedule()
    ends = StopCheck(sched.max_model_len).check(out, {"a": tokens[0]})
    assert (ends["a"].tokens, ends["a"].status, ends["a"].stop_reason) == want


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    path = tmp_path_factory.mktemp("tiny-stop")
    save_checkpoint(CONFIGS["llama_gqa_llama3"], path)
    save_tokenizer(path)
    return str(path)


def test_the_sample_stage_keeps_a_requests_generator_and_logprobs_until_it_ends(tiny_model):
    from kserve_paged_engine import SamplingParams
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_kv_blocks=64,
                                    max_model_len=64))
    states = engine.sampling.states
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=1, ignore_eos=True)
    engine.add_request("seeded", [5, 6, 7], params)
    engine.add_request("pair", [5, 6, 8], SamplingParams(max_tokens=3, n=2, seed=1,
                                                         ignore_eos=True))
    engine.add_request("gone", [5, 6, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(states) == 3  # the first sample of "pair" only: the other forks later
    engine.step()
    assert len(states) == 4  # the second sample of "pair" forked with its own generator
    engine.abort_request("gone")
    assert len(states) == 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(states) == 0  # every request ended: its generator and logprobs went with it
    seeded = [o for o in outputs if o.request_id == "seeded"][-1].outputs[0]
    assert len(seeded.logprobs) == 4  # kept until its last output was built
    # The same seed draws the same tokens again: nothing of the first run's state was reused.
    engine.add_request("again", [5, 6, 7], params)
    again = []
    while engine.has_unfinished_requests():
        again += engine.step()
    assert again[-1].outputs[0].token_ids == seeded.token_ids
    assert len(states) == 0
