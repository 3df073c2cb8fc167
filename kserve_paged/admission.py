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

The deadline is an argument, from the route to the engine: :class:`DeadlineMiddleware` starts
the clock when a request arrives and puts the deadline the server and the header give on
``request.state.deadline`` (and, for KServe's v1/v2 routes, which hand the model only the
request's headers, in the header ``x-kserve-paged-deadline``); the route reads it once
(:func:`route_deadline`, :func:`headers_deadline`), tightens it with the body's own, and
passes it down to ``PagedLLMModel.submit``, which hands it to the engine.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kserve_paged_engine import limits

TIMEOUT_HEADER = "x-request-timeout"
MICROSECONDS = 1_000_000  # per second: the unit of v1/v2 ``parameters.timeout``
# Where the middleware hands the deadline (time.monotonic()) to KServe's routes. A client's own
# copy is dropped on the way in over HTTP; gRPC metadata reaches `predict`'s headers without the
# middleware, so what the middleware writes is sealed with a secret of this process, and an
# unsealed value is not read.
DEADLINE_HEADER = "x-kserve-paged-deadline"
_DEADLINE_HEADER_BYTES = DEADLINE_HEADER.encode("latin-1")
_SEAL = secrets.token_hex(16)


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


def tighten(deadline: float | None, timeout_s: float | None,
            start: float | None = None) -> float | None:
    """The earlier of ``deadline`` and ``timeout_s`` after ``start`` (default now)."""
    if timeout_s is None:
        return deadline
    mine = (time.monotonic() if start is None else start) + timeout_s
    return mine if deadline is None or mine < deadline else deadline


def route_deadline(request: Request, timeout_s: float | None = None) -> float | None:
    """The request's deadline as the middleware set it, tightened by ``timeout_s`` (the
    body's ``timeout``, checked here: ValueError naming it)."""
    deadline = getattr(request.state, "deadline", None)
    if timeout_s is None:
        return deadline
    return tighten(deadline, parse_timeout(timeout_s, "timeout"))


def sealed_deadline(deadline: float) -> str:
    """The header value the middleware writes: the deadline and this process's seal."""
    return f"{deadline!r};{_SEAL}"


def headers_deadline(headers: dict[str, str] | None) -> float | None:
    """The deadline the middleware put in the headers KServe hands a model's ``predict``
    (None: none, or a value it did not write, as a gRPC client's metadata)."""
    value = (headers or {}).get(DEADLINE_HEADER)
    if value is None:
        return None
    number, _, seal = value.partition(";")
    if not hmac.compare_digest(seal.encode(), _SEAL.encode()):
        return None
    try:
        deadline = float(number)
    except ValueError:
        return None
    return deadline if math.isfinite(deadline) else None


def queue_full(waiting: int, limit: int) -> RequestRefused:
    return RequestRefused(
        429, f"the server has {waiting} requests waiting, its limit (--max_waiting_requests "
             f"{limit}): try again shortly", {"Retry-After": str(limits.QUEUE_FULL_RETRY_AFTER_S)})


class DeadlineMiddleware:
    """Starts each request's clock: the server default and ``x-request-timeout`` set the
    deadline (``request.state.deadline``) before any route runs; a malformed header is a
    400."""

    def __init__(self, app: Any, default_timeout_s: float | None = None) -> None:
        self.app = app
        self.default_timeout_s = default_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        deadline = tighten(None, self.default_timeout_s, start)
        headers = [(k, v) for k, v in scope.get("headers", ())
                   if k.lower() != _DEADLINE_HEADER_BYTES]
        header = next((v for k, v in headers
                       if k.decode("latin-1").lower() == TIMEOUT_HEADER), None)
        if header is not None:
            try:
                deadline = tighten(deadline, parse_timeout(header.decode("latin-1"),
                                                           TIMEOUT_HEADER), start)
            except ValueError as exc:
                await _error(scope, 400, str(exc))(scope, receive, send)
                return
        if deadline is not None:
            headers.append((_DEADLINE_HEADER_BYTES, sealed_deadline(deadline).encode("latin-1")))
        scope = {**scope, "headers": headers,
                 "state": {**scope.get("state", {}), "deadline": deadline}}
        await self.app(scope, receive, send)


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

