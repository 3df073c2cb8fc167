"""Admission: the waiting queue's bound and request deadlines (issue 37 part 3).

- ``--max_waiting_requests N``: a request that would find N or more requests already waiting
  is refused with 429 and ``Retry-After`` before it is queued, and counted in
  ``vllm:num_requests_rejected_total{reason="queue_full"}`` (ours, in vLLM's style).
- A deadline per request, the earliest of: the server's ``--request_timeout_s``, the header
  ``x-request-timeout: <seconds>`` (ours; any route), the OpenAI body's ``timeout`` (vLLM
  has none of the three) and the v1/v2 ``parameters.timeout`` (microseconds: Triton's
  schedule-policy parameter, which tritonclient's ``infer(timeout=...)`` sends). The clock
  starts when the request arrives. At the deadline the request is aborted wherever it is
  (waiting, compiling its grammar, running), its KV blocks freed, and it answers 408, or,
  once a stream has started, ends the stream with an error event;
  ``vllm:num_requests_timed_out_total`` counts it.

The deadline travels with the request's context (a context variable set by
:class:`DeadlineMiddleware`, tightened by the body), so every route and every served model
reads the same one in ``PagedLLMModel.submit``.
"""

from __future__ import annotations

import contextvars
import math
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kserve_paged_engine import limits

TIMEOUT_HEADER = "x-request-timeout"
MICROSECONDS = 1_000_000  # per second: the unit of v1/v2 ``parameters.timeout``
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "request_deadline", default=None)


class RequestRefused(Exception):
    """Answered with ``status`` (429: the queue is full) and ``headers``, in the route's
    error shape."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def parse_timeout(value: Any, source: str) -> float:
    """Seconds from ``value`` (a number, or text of one): finite, > 0 and at most
    limits.MAX_REQUEST_TIMEOUT_S; ValueError naming ``source`` otherwise."""
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds <= limits.MAX_REQUEST_TIMEOUT_S:
        raise ValueError(f"{source} must be a number of seconds in (0, "
                         f"{limits.MAX_REQUEST_TIMEOUT_S:g}] (got {str(value)[:40]!r})")
    return seconds


def parse_timeout_us(value: Any, source: str) -> float | None:
    """Seconds from a v1/v2 ``parameters.timeout``: a whole number of microseconds, as Triton
    reserves the parameter (a string of one too, as gRPC may carry it); 0 is Triton's "no
    deadline of its own" (None). ValueError naming ``source`` otherwise."""
    limit = int(limits.MAX_REQUEST_TIMEOUT_S * MICROSECONDS)
    number = value.strip() if isinstance(value, str) else value
    if isinstance(number, str) and number.isdigit():
        number = int(number)
    if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number <= limit:
        raise ValueError(f"{source} must be a whole number of microseconds in [0, {limit}] "
                         f"(Triton's schedule-policy timeout; 0: none) (got "
                         f"{str(value)[:40]!r})")
    return number / MICROSECONDS if number else None


def tighten(timeout_s: float, start: float | None = None) -> None:
    """Make this request's deadline at most ``timeout_s`` after ``start`` (default now)."""
    deadline = (time.monotonic() if start is None else start) + timeout_s
    current = request_deadline.get()
    if current is None or deadline < current:
        request_deadline.set(deadline)


def queue_full(waiting: int, limit: int) -> RequestRefused:
    return RequestRefused(
        429, f"the server has {waiting} requests waiting, its limit (--max_waiting_requests "
             f"{limit}): try again shortly", {"Retry-After": str(limits.QUEUE_FULL_RETRY_AFTER_S)})


class DeadlineMiddleware:
    """Starts each request's clock: the server default and ``x-request-timeout`` set the
    deadline before any route runs; a malformed header is a 400."""

    def __init__(self, app: Any, default_timeout_s: float | None = None) -> None:
        self.app = app
        self.default_timeout_s = default_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        token = request_deadline.set(None)
        try:
            if self.default_timeout_s is not None:
                tighten(self.default_timeout_s, start)
            header = next((v for k, v in scope.get("headers", ())
                           if k.decode("latin-1").lower() == TIMEOUT_HEADER), None)
            if header is not None:
                try:
                    tighten(parse_timeout(header.decode("latin-1"), TIMEOUT_HEADER), start)
                except ValueError as exc:
                    await _error(scope, 400, str(exc))(scope, receive, send)
                    return
            await self.app(scope, receive, send)
        finally:
            request_deadline.reset(token)


def _error(scope: dict[str, Any], status: int, message: str,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the route asked: OpenAI's under /openai and /v1/ (but
    KServe's v1 ``/v1/models``), v2's ``{"error": message}`` elsewhere."""
    path = scope.get("path", "")
    openai = path.startswith("/openai/") or (path.startswith("/v1/")
                                             and not path.startswith("/v1/models"))
    if openai:
        kind = {400: "invalid_request_error", 408: "timeout_error",
                429: "rate_limit_error"}.get(status, "server_error")
        content: dict[str, Any] = {"error": {"message": message, "type": kind, "param": None,
                                             "code": status}}
    else:
        content = {"error": message}
    return JSONResponse(status_code=status, content=content, headers=headers)


async def refused_route(request: Request, exc: RequestRefused) -> JSONResponse:
    """RequestRefused raised under KServe's v1/v2 routes."""
    return _error(request.scope, exc.status, str(exc), exc.headers)

