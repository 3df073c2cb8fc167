"""The token-budget scheduler: chunked prefill, policies, preemption, admission errors."""

import re

import pytest

from kserve_paged_engine.core.request import RequestStatus
from kserve_paged_engine.frontend.stop_check import StopCheck
from kserve_paged_engine.limits import request_id_in_use
from tests.helpers.core import (
    apply_step,
    fake_step,
    make_request,
    make_scheduler,
    run_to_completion,
)


def step(sched):
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out))
    return out


def test_chunked_prefill_splits_three_long_prompts_over_the_budget():
    sched = make_scheduler(num_blocks=256, budget=1024)
    reqs = {rid: make_request(rid, 1000, max_tokens=4) for rid in "abc"}
    for req in reqs.values():
        sched.add_request(req)
    splits = [step(sched).num_scheduled_tokens for _ in range(4)]
    assert splits[0] == {"a": 1000, "b": 24}
    assert splits[1] == {"a": 1, "b": 976, "c": 47}
    assert splits[2] == {"a": 1, "b": 1, "c": 953}
    assert splits[3] == {"a": 1, "b": 1, "c": 1}
    assert all(sum(s.values()) <= 1024 for s in splits)
    # A chunk that stops short of the prompt's end samples nothing.
    assert [reqs[r].num_output_tokens for r in "abc"] == [4, 3, 2]


def test_prefix_hit_counts_as_computed_and_shrinks_the_chunk():
    sched = make_scheduler(num_blocks=256, budget=4096)
    shared = list(range(1000, 1400))
    sched.add_request(make_request("a", shared + [1] * 20))
    sched.add_request(make_request("b", shared + [2] * 20))
    out = sched.schedule()
    # b is admitted in the same step and already hits a's 25 full blocks (400 tokens).
    assert out.num_scheduled_tokens == {"a": 420, "b": 20}
    assert sched.requests["b"].num_cached_tokens == 400


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(num_blocks=256, max_num_seqs=3)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 20))
    out = step(sched)
    assert len(out.scheduled) == 3 and sched.num_waiting == 2
    run_to_completion(sched)


def test_preemption_picks_the_latest_arrival_and_recomputes_it():
    # 6 blocks of 16; three requests of 30 tokens take 2 blocks each; decoding needs more.
    sched = make_scheduler(num_blocks=6, budget=512)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 30, max_tokens=10, arrival=float(i)))
    for _ in range(3):  # prefill (30 tokens, one sampled), then decodes up to 32 tokens
        assert not step(sched).preempted
    assert sched.kv.num_free_blocks == 0
    out = step(sched)
    # a needs a third block for its 33rd token: c (latest) is preempted to make room.
    assert out.preempted == ["c"]
    c = sched.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_output_tokens == 3  # its sampled tokens are kept and recomputed later  # its sampled token is kept and recomputed later
    assert sched.num_preemptions == 1
    outs = run_to_completion(sched)
    assert sched.kv.num_free_blocks == 6
    assert all(o.total_num_scheduled_tokens <= 512 for o in outs)


def test_priority_arrival_preempts_the_lowest_priority_running_request():
    sched = make_scheduler(num_blocks=8, budget=512, policy="priority")
    sched.add_request(make_request("low", 60, max_tokens=50, priority=5, arrival=0.0))
    sched.add_request(make_request("mid", 60, max_tokens=50, priority=1, arrival=1.0))
    step(sched)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make_request("high", 40, max_tokens=5, priority=0, arrival=2.0))
    out = step(sched)
    assert out.preempted == ["low"]
    assert "high" in out.num_scheduled_tokens and "mid" in out.num_scheduled_tokens
    assert sched.requests["low"].status is RequestStatus.PREEMPTED
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 8


def test_priority_policy_orders_waiting_by_priority_then_arrival():
    sched = make_scheduler(num_blocks=256, max_num_seqs=1, policy="priority")
    sched.add_request(make_request("late-important", 10, priority=-1, arrival=5.0))
    sched.add_request(make_request("early", 10, priority=0, arrival=1.0))
    sched.add_request(make_request("early-important", 10, priority=-1, arrival=2.0))
    firsts = []
    while sched.has_unfinished():
        out = step(sched)
        for r in out.scheduled:
            if r.request_id not in firsts:
                firsts.append(r.request_id)
    assert firsts == ["early-important", "late-important", "early"]


def test_fcfs_never_starves_the_head_of_the_queue():
    # A big request at the head waits for blocks while small ones keep arriving behind it.
    sched = make_scheduler(num_blocks=10, budget=256, max_num_seqs=8)
    sched.add_request(make_request("first", 60, max_tokens=20))
    step(sched)
    sched.add_request(make_request("big", 140, max_tokens=2))
    steps_until_big = None
    for i in range(200):
        if i % 3 == 0:
            sched.add_request(make_request(f"s{i}", 10, max_tokens=3))
        out = step(sched)
        if "big" in out.num_scheduled_tokens:
            steps_until_big = i
            break
        # nothing queued behind the head jumps ahead of it
        assert all(not r.request_id.startswith("s") for r in out.scheduled)
    assert steps_until_big is not None
    run_to_completion(sched)


def test_requests_that_can_never_fit_are_refused_when_added():
    sched = make_scheduler(num_blocks=4, block_size=16)  # pool = 64 tokens = max_model_len
    with pytest.raises(ValueError, match="maximum context length"):
        sched.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="empty"):
        make_request("empty", [])
    sched.add_request(make_request("ok", 10))
    with pytest.raises(ValueError, match=re.escape(request_id_in_use("ok"))):
        sched.add_request(make_request("ok", 10))
    assert sched.abort("unknown") is False
    assert sched.kv.num_free_blocks == 4


def test_request_stops_at_max_model_len_with_length():
    sched = make_scheduler(num_blocks=4, block_size=16)
    req = make_request("r", 60, max_tokens=100)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.num_tokens == 64 and req.finish_reason == "length"


def test_eos_stop_token_and_min_tokens():
    from kserve_paged_engine.core.request import Request
    from kserve_paged_engine.sampling_params import SamplingParams
    sched = make_scheduler()
    eos = Request("eos", [5, 6, 7], SamplingParams(max_tokens=10), eos_token_id=7)
    stop = Request("stop", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    ign = Request("ign", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=7)
    mint = Request("min", [5], SamplingParams(max_tokens=10, min_tokens=2), eos_token_id=7)
    for r in (eos, stop, ign, mint):
        sched.add_request(r)
    run_to_completion(sched)  # every step samples token 7
    assert eos.output_token_ids == [7] and eos.finish_reason == "stop"
    assert stop.output_token_ids == [7] and stop.stop_reason == 7
    assert ign.output_token_ids == [7, 7, 7] and ign.finish_reason == "length"
    assert mint.output_token_ids == [7, 7] and mint.finish_reason == "stop"


def test_priority_running_requests_are_served_best_first_so_the_worse_one_is_preempted():
    # L was admitted first; H (better) needs a new block while L does not. Walking the running
    # list in admission order would schedule L first and leave H to preempt itself.
    sched = make_scheduler(num_blocks=4, block_size=16, budget=512, policy="priority")
    low = make_request("low", 20, max_tokens=40, priority=5, arrival=0.0)
    sched.add_request(low)
    step(sched)
    high = make_request("high", 31, max_tokens=40, priority=0, arrival=1.0)
    sched.add_request(high)
    step(sched)  # high admitted (2 blocks): the pool is full
    step(sched)  # high's token 32 still fits
    out = step(sched)  # high needs a third block
    assert out.preempted == ["low"]
    assert high.status is RequestStatus.RUNNING and "high" in out.num_scheduled_tokens


def test_no_preemption_for_a_waiting_request_that_would_still_not_fit():
    sched = make_scheduler(num_blocks=10, block_size=16, budget=512, policy="priority")
    sched.add_request(make_request("best", 100, max_tokens=5, priority=0, arrival=0.0))  # 7
    step(sched)
    low = make_request("low", 20, max_tokens=5, priority=5, arrival=1.0)  # 2 blocks
    sched.add_request(low)
    step(sched)
    assert sched.kv.num_free_blocks == 1
    sched.add_request(make_request("mid", 70, max_tokens=5, priority=1, arrival=2.0))  # 5
    out = step(sched)
    # Preempting "low" would free 2 blocks: 3 < 5, so it keeps running and "mid" waits.
    assert out.preempted == [] and low.status is RequestStatus.RUNNING
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 10


class _Texts:
    """A stand-in for the detokenizers the stop check asks: `answer(token, ended_by_token,
    check_stop)` is the stop string the text now ends in."""

    def __init__(self, answer):
        self.answer = answer

    def detokenize(self, request_id, token, ended_by_token, check_stop):
        return self.answer(token, ended_by_token, check_stop)


def _decode_until(sched, rid: str, tokens: list[int], answer=None):
    """Prefill `rid`, then feed `tokens` one step each (the request's sampled tokens): the
    stop check first (with stop strings from `answer`), then the scheduler."""
    stops = StopCheck(sched.max_model_len, _Texts(answer) if answer else None)
    for token in tokens:
        out = sched.schedule()
        sched.update_from_output(out, stops.check(out, {rid: token}))
        if rid not in sched.requests:
            return out
    return None


@pytest.mark.parametrize(("tokens", "stop_at", "status", "reason"), [
    ([7, 9, 2], None, RequestStatus.FINISHED_STOPPED, None),      # EOS
    ([7, 5, 9], None, RequestStatus.FINISHED_STOPPED, 5),         # a stop token id
    ([7, 7, 7, 7], None, RequestStatus.FINISHED_LENGTH, None),    # max_tokens
    ([7, 8, 9], 1, RequestStatus.FINISHED_STOPPED, "stop!"),      # a stop string
    # string over EOS (with include_stop_str_in_output the EOS text is searched too)
    ([7, 2], 1, RequestStatus.FINISHED_STOPPED, "stop!"),
    ([7, 7, 7, 7], 3, RequestStatus.FINISHED_STOPPED, "stop!"),   # string over length
])
def test_the_stop_check_decides_each_ending_once(tokens, stop_at, status, reason):
    sched = make_scheduler()
    req = make_request("a", 20, max_tokens=4, ignore_eos=False)
    req.sampling_params.stop_token_ids = [5]
    sched.add_request(req)
    seen: list[tuple[int, bool]] = []

    def stop_strings(token, ended_by_token, check_stop):
        seen.append((token, ended_by_token))
        return "stop!" if len(seen) - 1 == stop_at else None

    _decode_until(sched, "a", tokens, stop_strings)
    assert req.status is status and req.stop_reason == reason
    assert "a" not in sched.requests and sched.kv.num_free_blocks == sched.kv.num_blocks
    # The detokenizer saw every token once, told whether a token ended the request.
    assert [t for t, _ in seen] == req.output_token_ids
    assert [ended for _, ended in seen] == [t in (2, 5) for t in req.output_token_ids]


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings():
    sched = make_scheduler()
    req = make_request("a", 20, max_tokens=8, ignore_eos=False)
    req.sampling_params.min_tokens = 3
    req.sampling_params.stop_token_ids = [5]
    sched.add_request(req)
    # EOS and a stop token before the third output do not end it, and neither does a stop
    # string: the detokenizer is asked with may-stop False (it then does not search) until
    # min_tokens is reached; the stand-in here answers as the real one would.
    asked: list[bool] = []

    def stop_strings(token, ended_by_token, check_stop):
        asked.append(check_stop)
        return "stop!" if check_stop else None

    _decode_until(sched, "a", [2, 5, 7], stop_strings)
    assert asked == [False, False, True]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "stop!"
    assert req.num_output_tokens == 3


def test_a_fork_may_not_take_a_live_request_id():
    """A fork's id is refused in the same words as an added request's (one message)."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    step(sched)
    with pytest.raises(ValueError, match=re.escape(request_id_in_use("b"))):
        sched.fork(sched.requests["a"], "b")
    assert sched.fork(sched.requests["a"], "a2").request_id == "a2"
