"""The soak's pure parts (bench/soak_checks.py, soak_client's answer assembly, soak_requests'
mix): its verdicts must fail on what they claim to catch. No server: runs in milliseconds."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak_checks  # noqa: E402
import soak_requests  # noqa: E402
from soak_client import (  # noqa: E402
    DISCONNECTED,
    FINISHED,
    REFUSED,
    SERVER_ERROR,
    Outcome,
    StreamAssembler,
    answer_of,
    cached_tokens,
)

# One unload/load cycle of a1: unload sent at 10, answered 11; load sent 15, answered 16.
EVENTS = [{"name": "a1", "action": "unload", "sent": 10.0, "done": 11.0, "status": 200},
          {"name": "a1", "action": "load", "sent": 15.0, "done": 16.0, "status": 200}]


@pytest.mark.parametrize(("t0", "t1", "want"), [
    (1, 9, "loaded"), (17, 30, "loaded"), (12, 14, "unloaded"), (9, 12, "changing"),
    (14, 20, "changing"), (10.5, 10.8, "changing"), (5, 40, "changing")])
def test_adapter_window(t0, t1, want):
    assert soak_checks.adapter_window(EVENTS, "a1", t0, t1) == want
    assert soak_checks.adapter_window(EVENTS, "a2", t0, t1) == "loaded"


def test_a_failed_unload_never_makes_the_adapter_surely_gone():
    events = [{**EVENTS[0], "status": 500}, EVENTS[1]]
    assert soak_checks.adapter_window(events, "a1", 12, 14) == "changing"


def test_an_unload_without_its_load_leaves_the_adapter_changing():
    assert soak_checks.adapter_window(EVENTS[:1], "a1", 20, 21) == "changing"


def _out(kind="completion", status=200, result=FINISHED, answer=("x",), **kw) -> Outcome:
    o = Outcome(kind, 0, soak_requests.CMPL, False, kw.pop("t_send", 0.0),
                t_end=kw.pop("t_end", 1.0), status=status, result=result,
                answer=list(answer) if answer is not None else None,
                ref_key=kw.pop("ref_key", f"{kind}/0"), **kw)
    return o


def test_judge_passes_equal_answers_and_expected_refusals():
    outs = [_out(compare="exact"), _out(kind="invalid", status=400, result=REFUSED,
                                        answer=None, expect=400),
            _out(kind="n_greedy", compare="exact", answer=("x", "x", "x"), ref_repeat=3,
                 ref_key="completion/0"),
            _out(kind="disconnect", status=200, result=DISCONNECTED, answer=None)]
    j = soak_checks.judge(outs, {"completion/0": ["x"]}, [])
    assert j["failures"] == [] and j["mismatches"] == [] and j["compared"] == 2
    assert j["sent"] == 4 and j["answered"] == 2 and j["refused_by_code"] == {"400": 1}
    assert j["disconnected"] == 1


def test_judge_fails_a_differing_greedy_answer_but_only_reports_a_seeded_one():
    outs = [_out(compare="exact", answer=("y",)),
            _out(kind="n_sampled", compare="report", answer=("y",), ref_key="n_sampled/0")]
    j = soak_checks.judge(outs, {"completion/0": ["x"], "n_sampled/0": ["x"]}, [])
    assert len(j["mismatches"]) == 1 and j["mismatches"][0]["alone"] == ["x"]
    assert j["seeded_vs_alone"] == {"different": 1} and j["failures"] == []
    assert j["compared"] == 1  # the seeded one is not


@pytest.mark.parametrize("bad", [
    _out(status=500, result=SERVER_ERROR, answer=None),
    _out(status=None, result="timeout", answer=None),
    _out(status=200, result="incomplete"),
    _out(status=200, result="stream_error"),
    _out(kind="invalid", status=404, result=REFUSED, answer=None, expect=400),
    _out(kind="invalid", status=200, answer=None, expect=400)])
def test_judge_fails_what_is_not_the_expected_answer(bad):
    j = soak_checks.judge([bad], {"completion/0": ["x"]}, [])
    assert len(j["failures"]) == 1


@pytest.mark.parametrize(("t0", "t1", "status", "fails"), [
    (1, 2, 200, False), (1, 2, 404, True),      # loaded throughout: must be served
    (12, 14, 404, False), (12, 14, 200, True),  # surely unloaded: must be 404
    (9, 12, 200, False), (9, 12, 404, False)])  # during a change: either
def test_judge_holds_adapter_requests_to_the_adapter_state(t0, t1, status, fails):
    o = _out(kind="lora", status=status, result=FINISHED if status == 200 else REFUSED,
             adapter="a1", t_send=t0, t_end=t1, compare="exact")
    assert bool(soak_checks.judge([o], {"lora/0": ["x"]}, EVENTS)["failures"]) is fails


def test_rss_growth_is_measured_from_the_end_of_warm_up():
    samples = [{"t": 0, "rss_mib": 500}, {"t": 30, "rss_mib": 1000},
               {"t": 60, "rss_mib": 1040}, {"t": 90, "rss_mib": 1020}]
    v = soak_checks.rss_growth(samples, warmup_s=30)
    assert v["ok"] is True and v["baseline_mib"] == 1000 and v["peak_mib"] == 1040
    samples[2]["rss_mib"] = 1060
    assert soak_checks.rss_growth(samples, warmup_s=30)["ok"] is False
    assert soak_checks.rss_growth(samples, warmup_s=90)["ok"] is None


def test_leaks_find_held_kv_requests_fds_and_threads():
    idle = {"vllm:kv_cache_usage_perc": 0.0, "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0, "fds": 40, "threads": 30}
    assert soak_checks.leaks(idle, {**idle, "fds": 50})["ok"] is True
    for bad in ({"vllm:kv_cache_usage_perc": 0.02}, {"vllm:num_requests_running": 1.0},
                {"fds": 40 + soak_checks.FD_SLACK + 1},
                {"threads": 30 + soak_checks.THREAD_SLACK + 1}):
        v = soak_checks.leaks(idle, {**idle, **bad})
        assert v["ok"] is False and set(v["found"]) == set(bad)


def _sse(events: list[dict]) -> StreamAssembler:
    return _feed(StreamAssembler(chat=False), events)


def _feed(s: StreamAssembler, events: list[dict]) -> StreamAssembler:
    for e in events:
        s.feed("data: " + json.dumps(e))
    s.feed("data: [DONE]")
    return s


def test_a_streamed_completion_assembles_to_the_non_streamed_answer():
    body = {"choices": [{"index": 1, "text": "ab", "finish_reason": "length"},
                        {"index": 0, "text": "cd", "finish_reason": "stop"}]}
    chunks = [{"choices": [{"index": 0, "text": "c"}]}, {"choices": [{"index": 1, "text": "a"}]},
              {"choices": [{"index": 1, "text": "b", "finish_reason": "length"}]},
              {"choices": [{"index": 0, "text": "d", "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}]
    s = _sse(chunks)
    assert s.complete and s.answer() == answer_of(soak_requests.CMPL, body)[0] == ["cd", "ab"]
    assert cached_tokens(s.usage) == 32
    unfinished = _sse(chunks[:3])
    assert not unfinished.complete  # choice 0 never got its finish_reason


def test_a_streamed_tool_call_assembles_to_the_non_streamed_answer():
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"function": {"name": "get_time",
                                                      "arguments": '{"timezone": "JST"}'}}]}}]}
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"name": "get_time", "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"arguments": '{"timezone": '}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"arguments": '"JST"}'}}]},
                            "finish_reason": "tool_calls"}]}]
    s = _feed(StreamAssembler(chat=True), chunks)
    assert s.complete and s.answer() == answer_of(soak_requests.CHAT, body)[0]


def test_an_error_event_or_a_missing_done_is_not_complete():
    s = StreamAssembler(chat=False)
    s.feed('data: {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}')
    assert not s.complete  # no [DONE]
    s.feed('data: {"error": {"message": "boom"}}')
    s.feed("data: [DONE]")
    assert not s.complete and "boom" in (s.error or "")


def test_the_mix_is_seeded_and_sends_every_kind_first():
    kinds = set(soak_requests.WEIGHTS)
    a = list(itertools.islice(soak_requests.mix("smol", 3, kinds), 600))
    assert a == list(itertools.islice(soak_requests.mix("smol", 3, kinds), 600))
    assert a != list(itertools.islice(soak_requests.mix("smol", 4, kinds), 600))
    assert {s.kind for s in a[:len(kinds)]} == kinds
    assert {s.stream for s in a if s.kind in soak_requests.STREAMABLE} == {False, True}
    no_lora = list(itertools.islice(soak_requests.mix("smol", 3, kinds - {"lora"}), 300))
    assert all(s.adapter is None and not s.route.endswith("_adapter") for s in no_lora)


def test_a_variant_cap_keeps_both_adapters_and_every_reference():
    kinds = set(soak_requests.WEIGHTS)
    refs = {s.ref_key for s in soak_requests.reference_specs("smol", kinds, cap=1)}
    assert {"lora/0", "lora/1", "completion/0"} <= refs and "completion/1" not in refs
    assert {"prefix/0", "prefix/1", "prefix/2"} <= refs and "prefix/3" not in refs
    assert {s.adapter for s in soak_requests.reference_specs("smol", kinds, cap=1)} == \
        {None, *soak_requests.ADAPTERS}
    sent = list(itertools.islice(soak_requests.mix("smol", 3, kinds, cap=1), 600))
    assert all(s.ref_key in refs for s in sent if s.compare)


def _unstreamed(body: dict) -> dict:
    return {k: x for k, x in body.items() if k not in ("stream", "stream_options")}


def test_every_request_has_one_body_per_key_and_invalid_ones_expect_4xx():
    refs = soak_requests.reference_specs("smol")
    assert len({s.ref_key for s in refs}) == len(refs) and all(s.compare for s in refs)
    for kind, n in soak_requests.VARIANTS.items():
        for v in range(n):
            streamed = soak_requests.valid_spec("smol", kind, v, True)
            plain = soak_requests.valid_spec("smol", kind, v, False)
            assert plain.ref_key == streamed.ref_key
            assert _unstreamed(streamed.body) == _unstreamed(plain.body)
    assert all(400 <= s.expect < 500 for s in soak_requests.invalid_specs("smol"))


def test_prefix_hits_tell_full_hits_from_evicted_blocks():
    outs = [_out(kind="prefix", cached_tokens=c) for c in (288, 288, 96, 0)]
    outs.append(_out(kind="prefix", cached_tokens=None))  # streamed: no usage
    assert soak_checks.prefix_hits(outs) == {"requests": 4, "full": 2, "evicted": 1, "none": 1}


def test_leaks_count_unanswered_metrics_as_not_measured_rather_than_zero():
    v = soak_checks.leaks({"fds": 40}, {"fds": 40})
    assert v["ok"] is False and v["found"]["vllm:kv_cache_usage_perc"] == "not measured"


def test_the_pid_behind_a_listening_port_is_found():
    import os
    import socket

    from soak_monitor import listening_pid, process_figures

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listening_pid(s.getsockname()[1]) == os.getpid()
    figures = process_figures(os.getpid())
    assert figures["rss_mib"] > 0 and figures["fds"] > 0 and figures["threads"] >= 1
    assert process_figures(None) == {}
