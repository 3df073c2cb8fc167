"""The pure parts of the benchmarks (bench/benchlib.py): metric arithmetic on synthetic
timestamps, seeded arrivals and workload shrinking. No server, no model: runs in milliseconds."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_serve import parse_sse_line, request_body  # noqa: E402
from benchlib import (  # noqa: E402
    RequestRecord,
    describe,
    load_workload,
    percentile,
    poisson_arrivals,
    ratio,
    shrink,
    summarize,
    synthetic_workload,
)


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_describe_scales_and_handles_empty():
    d = describe([0.1, 0.2, 0.3], scale=1000)
    assert d["mean"] == pytest.approx(200.0)
    assert d["p50"] == pytest.approx(200.0)
    assert d["p99"] == pytest.approx(298.0)
    assert describe([]) == {"mean": None, "p50": None, "p99": None}


def test_request_record_latencies():
    # sent at 10.0; text chunks at 10.5, 10.6, 10.8, 11.1; stream closed at 11.2; 5 tokens
    # (the last chunk carried two of them)
    r = RequestRecord(start=10.0, end=11.2, chunk_times=[10.5, 10.6, 10.8, 11.1],
                      prompt_tokens=7, output_tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((1.2 - 0.5) / 4)
    one = RequestRecord(start=0.0, end=0.3, chunk_times=[0.2], output_tokens=1)
    assert one.tpot is None and one.itls == []
    assert RequestRecord(start=0.0, end=1.0).ttft is None


def test_summarize_counts_only_successful_requests():
    good = [RequestRecord(start=0.0, end=2.0, chunk_times=[0.5, 1.0, 1.5], prompt_tokens=10,
                          output_tokens=3),
            RequestRecord(start=1.0, end=2.0, chunk_times=[1.2, 1.6], prompt_tokens=20,
                          output_tokens=2)]
    bad = RequestRecord(start=0.0, end=0.1, error="HTTP 500")
    s = summarize([*good, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(statistics.mean([750.0, 800.0]))
    assert s["itl_ms"]["p50"] == pytest.approx(500.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(1500.0)


def test_poisson_arrivals_seeded_and_at_rate():
    a = poisson_arrivals(2000, rate=4.0, seed=0)
    assert a == poisson_arrivals(2000, rate=4.0, seed=0)
    assert a != poisson_arrivals(2000, rate=4.0, seed=1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, 2.0) == []


def test_workloads_shrink_and_synthesize():
    w1 = load_workload("random")
    assert len(w1) == 64 and sum(r["max_tokens"] for r in w1) == 8557
    small = load_workload("shared", num_prompts=4, max_tokens=8)
    assert len(small) == 4 and all(r["max_tokens"] == 8 for r in small)
    assert shrink([{"prompt_token_ids": [1], "max_tokens": 3}], max_tokens=8)[0]["max_tokens"] == 3
    syn = synthetic_workload(3, input_len=5, output_len=2, seed=7)
    assert syn == synthetic_workload(3, input_len=5, output_len=2, seed=7)
    assert all(len(r["prompt_token_ids"]) == 5 and r["max_tokens"] == 2 for r in syn)


def test_sse_parsing_and_request_body():
    assert parse_sse_line(b'data: {"choices": [{"text": "a"}]}\n') == {"choices": [{"text": "a"}]}
    assert parse_sse_line(b"data: [DONE]\n") is None
    assert parse_sse_line(b"\n") is None and parse_sse_line(": keep-alive") is None
    body = request_body("smol", {"prompt_token_ids": [5, 6], "max_tokens": 3})
    assert body["prompt"] == [5, 6] and body["ignore_eos"] is True and body["stream"] is True
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}


def test_ratio():
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(None, 1.0) is None and ratio(1.0, 0) is None
