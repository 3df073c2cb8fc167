"""Tracing wired into the server (kserve_paged/server.py's install with a tracer, the span
started in PagedLLMModel.submit): one span per request on every front end, the caller's
traceparent continued, adapters named; and nothing of it when tracing is off."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kserve_paged.tracing import RequestTracer, TraceContextMiddleware
from tests.helpers.otlp_receivers import GrpcReceiver
from tests.helpers.server import NAME, V2_BODY, client, ready, run

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def test_one_span_per_request_with_the_callers_trace(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    receiver = GrpcReceiver()
    try:
        tracer = RequestTracer(receiver.endpoint, detailed=True, service_name="t")

        async def main() -> None:
            app, model, _ = await ready(tracer=tracer)
            async with client(app) as c:
                r = await c.post("/v1/chat/completions", headers={"traceparent": PARENT},
                                 json={"model": NAME, "max_tokens": 3,
                                       "messages": [{"role": "user", "content": "one"}]})
                assert r.status_code == 200
                r = await c.post(f"/v2/models/{NAME}/infer", json=V2_BODY)  # two prompts
                assert r.status_code == 200
                r = await c.post("/v1/completions", json={"model": NAME, "prompt": "",
                                                          "max_tokens": 1})
                assert r.status_code == 400  # refused before submission: no span

                async def refuse(*args, **kwargs):
                    raise ValueError("the queue is full")
                model.llm.add = refuse  # the engine refuses it: the entry is dropped
                r = await c.post("/v1/completions", json={"model": NAME, "prompt": "one",
                                                          "max_tokens": 1})
                assert r.status_code == 400 and "queue is full" in r.text
            assert tracer._pending == {}  # every started entry ended or was dropped
            model.stop_engine()
        run(main())
        tracer.shutdown()
    finally:
        receiver.stop()
    spans = receiver.spans
    assert len(spans) == 3
    chat = next(s for s in spans if s["attributes"]["gen_ai.request.id"].startswith("chatcmpl"))
    assert chat["trace_id"] == TRACE_ID and chat["parent_span_id"] == "b7ad6b7169203331"
    a = chat["attributes"]
    assert a["gen_ai.response.model"] == NAME and a["gen_ai.request.max_tokens"] == 3
    assert a["gen_ai.usage.completion_tokens"] == 3 and a["gen_ai.usage.prompt_tokens"] > 0
    for phase in ("time_in_queue", "time_to_first_token", "time_in_model_prefill",
                  "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{phase}"] >= 0, phase
    v2 = [s for s in spans if s is not chat]
    assert {s["trace_id"] for s in v2} & {TRACE_ID} == set()  # no traceparent: new traces
    assert sorted(s["attributes"]["gen_ai.usage.prompt_tokens"] for s in v2) == [1, 2]
    assert all(abs(s["end"] / 1e9 - time.time()) < 60 for s in spans)


@pytest.mark.slow
def test_tracing_off_installs_nothing_and_loads_no_sdk_or_exporter():
    """KServe itself imports OpenTelemetry's API; the SDK and the exporters are ours alone."""
    async def main() -> None:
        app, model, _ = await ready()
        assert model.tracer is None
        assert all(m.cls is not TraceContextMiddleware for m in app.user_middleware)
        model.stop_engine()
    run(main())
    code = ("import sys, asyncio\n"
            "from tests.helpers.server import ready, client, NAME\n"
            "async def main():\n"
            "    app, model, _ = await ready()\n"
            "    async with client(app) as c:\n"
            "        r = await c.post('/v1/completions', json={'model': NAME, 'prompt': 'a',"
            " 'max_tokens': 2})\n"
            "        assert r.status_code == 200\n"
            "    model.stop_engine()\n"
            "asyncio.run(main())\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',"
            " 'opentelemetry.exporter'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("header", [{}, {"traceparent": PARENT, "tracestate": "k=v"}])
def test_the_middleware_keeps_only_the_trace_headers(header):
    from kserve_paged.tracing import request_headers

    seen = []

    async def app(scope, receive, send):
        seen.append(dict(request_headers()))

    scope = {"type": "http", "headers": [(b"host", b"x"), *((k.encode(), v.encode())
                                                           for k, v in header.items())]}
    run(TraceContextMiddleware(app)(scope, None, None))
    assert seen == [header] and request_headers() == {}
