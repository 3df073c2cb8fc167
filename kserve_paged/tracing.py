"""Request tracing over OTLP: one span per request, as vLLM's `--otlp-traces-endpoint` exports.

Off unless `--otlp-traces-endpoint` is given, and then nothing of OpenTelemetry is imported or
run on a request's path but a dictionary entry at submission. The span is written when the
request ends, from the engine's own timestamps (arrival, first scheduled, first token, last
token, finished), so it costs no work per token. A `traceparent` header on the HTTP request
(W3C trace context) makes the span a child of the caller's.

The exporter follows the endpoint and OpenTelemetry's own variables: OTLP over gRPC by default
(KServe's default collector is `http://otel-collector:4317`), over HTTP when
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or `OTEL_EXPORTER_OTLP_PROTOCOL`) is `http/protobuf`; an
HTTP endpoint without a path gets `/v1/traces`. `OTEL_SERVICE_NAME` names the service.
Attribute names are vLLM's (`gen_ai.*`), so dashboards built for it read ours.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger("kserve.paged")

SPAN_NAME = "llm_request"
DETAIL_LEVELS = ("model", "worker", "all")
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# The trace-context headers of the HTTP request being handled (set by TraceContextMiddleware,
# installed only when tracing is on), read where the request is submitted.
_request_headers: ContextVar[Mapping[str, str] | None] = ContextVar(
    "kserve_paged_trace_headers", default=None)


def detail_levels(text: str | None) -> frozenset[str]:
    """`--collect-detailed-traces` (`all`, or a comma list of model, worker): ValueError for
    anything else."""
    levels = frozenset(p.strip() for p in (text or "").split(",") if p.strip())
    unknown = sorted(levels - set(DETAIL_LEVELS))
    if unknown:
        raise ValueError(f"--collect-detailed-traces: unknown level(s) {unknown} (choose from "
                         f"{', '.join(DETAIL_LEVELS)})")
    return levels


def request_headers() -> Mapping[str, str]:
    """The trace-context headers of the request being handled ({} outside one)."""
    return _request_headers.get() or {}


class TraceContextMiddleware:
    """ASGI middleware: keeps the request's `traceparent` / `tracestate` for its span."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            found = {k.decode(): v.decode("latin-1") for k, v in scope["headers"]
                     if k in _TRACE_HEADERS}
            token = _request_headers.set(found)
            try:
                await self.app(scope, receive, send)
            finally:
                _request_headers.reset(token)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True, slots=True)
class _Pending:
    context: Any  # the caller's OpenTelemetry context (or an empty one)
    attributes: dict[str, Any]


def otlp_protocol() -> str:
    """`grpc` or `http/protobuf`, from OpenTelemetry's variables (traces-specific first)."""
    raw = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
           or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if raw not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {raw!r} is not supported (grpc or http/protobuf)")
    return raw


def _exporter(endpoint: str) -> Any:
    try:
        if otlp_protocol() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            insecure = urlparse(endpoint).scheme != "https"
            return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )
    except ImportError as exc:
        raise RuntimeError("--otlp-traces-endpoint needs the tracing extra: pip install "
                           f"'kserve-paged[tracing]' ({exc})") from None
    if urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HTTPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """`start` at submission, then called (as an engine step callback) with each step's
    outputs; a finished or aborted request's span is written then."""

    def __init__(self, endpoint: str, *, detailed: bool = False,
                 service_name: str | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "kserve-paged"
        self._provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("kserve_paged")
        self.detailed = detailed
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        # The engine's clock is monotonic; spans need the epoch.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        logger.info("tracing requests to %s over OTLP %s", endpoint, otlp_protocol())

    def start(self, request_id: str, headers: Mapping[str, str],
              attributes: Mapping[str, Any]) -> None:
        """Remember the caller's trace context and the request's attributes."""
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        carrier = {k.lower(): v for k, v in headers.items()}
        context = TraceContextTextMapPropagator().extract(carrier)
        entry = _Pending(context, {"gen_ai.request.id": request_id,
                                   **{k: v for k, v in attributes.items() if v is not None}})
        with self._lock:
            self._pending[request_id] = entry

    def discard(self, request_id: str) -> None:
        """Forget a request the engine refused (no span)."""
        with self._lock:
            self._pending.pop(request_id, None)

    def __call__(self, info: Any) -> None:
        for out in info.outputs:
            if out.finished:
                self._end(out.request_id, out)
        for rid in info.aborted:
            self._end(rid, None)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def _end(self, request_id: str, out: Any) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        attributes = dict(entry.attributes)
        t = getattr(out, "metrics", None)
        now = time.monotonic()
        start = t.arrival_time if t is not None else now
        end = t.finished_time if t is not None and t.finished_time is not None else now
        if out is not None:
            attributes["gen_ai.usage.prompt_tokens"] = len(out.prompt_token_ids)
            attributes["gen_ai.usage.completion_tokens"] = sum(len(c.token_ids)
                                                               for c in out.outputs)
        if t is not None:
            attributes.update(_latencies(t, end, self.detailed))
        span = self._tracer.start_span(SPAN_NAME, context=entry.context, kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=self._ns(start))
        if out is None:
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        """Write the spans still queued (at server exit)."""
        self._provider.shutdown()


def _latencies(t: Any, end: float, detailed: bool) -> dict[str, float]:
    """vLLM's latency attributes, in seconds; the phases only with detailed traces."""
    out = {"gen_ai.latency.e2e": end - t.arrival_time}
    if t.first_scheduled_time is not None:
        out["gen_ai.latency.time_in_queue"] = t.first_scheduled_time - t.arrival_time
    if t.first_token_time is not None:
        out["gen_ai.latency.time_to_first_token"] = t.first_token_time - t.arrival_time
    if detailed and t.first_scheduled_time is not None and t.first_token_time is not None:
        out["gen_ai.latency.time_in_model_prefill"] = t.first_token_time - t.first_scheduled_time
        if t.last_token_time is not None:
            out["gen_ai.latency.time_in_model_decode"] = t.last_token_time - t.first_token_time
            out["gen_ai.latency.time_in_model_inference"] = (t.last_token_time
                                                             - t.first_scheduled_time)
    return out


def request_attributes(params: Any, model_name: str) -> dict[str, Any]:
    """The request's own attributes (what was asked), from its SamplingParams."""
    return {"gen_ai.response.model": model_name,
            "gen_ai.request.max_tokens": getattr(params, "max_tokens", None),
            "gen_ai.request.temperature": getattr(params, "temperature", None),
            "gen_ai.request.top_p": getattr(params, "top_p", None),
            "gen_ai.request.n": getattr(params, "n", None)}
