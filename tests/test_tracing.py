"""Request spans over OTLP (kserve_paged/tracing.py), received by in-test collectors over gRPC
and HTTP: one span per request with vLLM's attribute names, the caller's trace continued."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kserve_paged.tracing import RequestTracer, otlp_protocol, request_attributes
from kserve_paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.helpers.otlp_receivers import GrpcReceiver, HttpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _finished(rid: str) -> RequestOutput:
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time=now - 0.5, first_scheduled_time=now - 0.4,
                             first_token_time=now - 0.3, last_token_time=now - 0.1,
                             finished_time=now)
    out = CompletionOutput(index=0, text="hi", token_ids=[5, 6, 7], finish_reason="stop")
    return RequestOutput(request_id=rid, prompt="", prompt_token_ids=[1, 2], outputs=[out],
                         finished=True, metrics=metrics)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_one_span_per_request_arrives_with_vllms_attributes(
        protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        tracer = RequestTracer(receiver.endpoint, detailed=True, service_name="test")
        params = SimpleNamespace(max_tokens=3, temperature=0.0, top_p=1.0, n=1)
        tracer.start("req-1", {"traceparent": PARENT}, request_attributes(params, "smol"))
        tracer.start("req-2", {}, request_attributes(params, "smol"))
        tracer(SimpleNamespace(outputs=[_finished("req-1")], aborted=[]))
        tracer(SimpleNamespace(outputs=[], aborted=["req-2"]))
        tracer(SimpleNamespace(outputs=[_finished("never-started")], aborted=[]))
        tracer.shutdown()  # flushes the batch
    finally:
        receiver.stop()
    spans = {s["attributes"]["gen_ai.request.id"]: s for s in receiver.spans}
    assert set(spans) == {"req-1", "req-2"}
    done = spans["req-1"]
    assert done["name"] == "llm_request"
    assert done["trace_id"] == TRACE_ID and done["parent_span_id"] == "00f067aa0ba902b7"
    a = done["attributes"]
    assert a["gen_ai.usage.prompt_tokens"] == 2 and a["gen_ai.usage.completion_tokens"] == 3
    assert a["gen_ai.response.model"] == "smol" and a["gen_ai.request.max_tokens"] == 3
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.1, abs=1e-6)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.2, abs=1e-6)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.1, abs=1e-6)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.2, abs=1e-6)
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.5, abs=1e-6)
    assert done["end"] - done["start"] == pytest.approx(0.5e9, rel=1e-3)
    assert abs(done["end"] / 1e9 - time.time()) < 60  # epoch time, not the monotonic clock
    aborted = spans["req-2"]
    assert aborted["status"] == 2  # STATUS_CODE_ERROR
    assert aborted["trace_id"] != TRACE_ID and aborted["parent_span_id"] == ""
    if protocol == "http/protobuf":
        assert receiver.paths == ["/v1/traces"] * len(receiver.paths)


def test_the_protocol_comes_from_opentelemetrys_variables(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert otlp_protocol() == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert otlp_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        otlp_protocol()
