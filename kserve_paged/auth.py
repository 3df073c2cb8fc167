"""`--api-key`: every route but health, readiness and metrics asks for the key.

Deny by default: the middleware wraps the whole app, so a route added later is protected
without anyone remembering to protect it; the open paths are listed here, once. The key comes
as `Authorization: Bearer KEY` (OpenAI's clients, vLLM) or, on the Messages routes, as
`x-api-key: KEY` (Anthropic's client). It is compared in constant time. A refusal is a 401 in
the shape of the route's protocol, before the body is read. KServe's model repository routes
are not let in by this key: they have a guard and a key of their own (model_control.py), which
marks a request it let in (`GRANTED`); no other request passes without this key.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

OPEN_PATHS = frozenset({
    "/", "/health", "/ping", "/metrics", "/version", "/v2/health/live", "/v2/health/ready"})
# Readiness of one model: v2's /v2/models/NAME[/versions/V]/ready and KServe v1's
# GET /v1/models/NAME (the name cannot hold a '/' or ':'; a predict URL has ':predict').
_OPEN_PATTERNS = (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/ready$"),
                  re.compile(r"^/v1/models/[^/:]+$"))
_MESSAGES = ("/v1/messages", "/openai/v1/messages")
# Set in a request's ASGI scope by a guard that checked a credential of its own
# (model_control.py, outside this middleware); a client cannot set it.
GRANTED = "kserve_paged.granted"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def is_open(method: str, path: str) -> bool:
    """True for the health, readiness and metrics routes, which stay open."""
    if path in OPEN_PATHS:
        return True
    if path.startswith("/v1/models/"):  # KServe v1 readiness is a GET; anything else is not
        return method == "GET" and bool(_OPEN_PATTERNS[1].match(path))
    return bool(_OPEN_PATTERNS[0].match(path))


def bearer_token(headers: dict[bytes, bytes]) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header, else None."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return None


def key_matches(token: bytes | None, key: bytes) -> bool:
    """The token is the key (compared in constant time)."""
    return token is not None and hmac.compare_digest(token, key)


async def send_refusal(send: Callable[[Any], Awaitable[None]], status: int,
                       content: dict[str, Any]) -> None:
    """Answer `status` with the JSON `content` (a 401 also says how to authenticate)."""
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _presented(path: str, headers: dict[bytes, bytes]) -> bytes | None:
    token = bearer_token(headers)
    if token is not None:
        return token
    if path.startswith(_MESSAGES):
        return headers.get(b"x-api-key")
    return None


def _refusal(path: str) -> dict[str, Any]:
    message = "missing or wrong API key: send it as 'Authorization: Bearer <key>'"
    if path.startswith(_MESSAGES):
        return {"type": "error", "error": {"type": "authentication_error",
                                           "message": message + " or 'x-api-key: <key>'"}}
    if path.startswith("/v2") or path.startswith("/v1/models/"):
        return {"error": message}  # v1/v2 protocol's error shape
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


class APIKeyMiddleware:
    """ASGI middleware: 401 unless the path is open or the request carries the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let everyone in")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if (scope["type"] != "http" or is_open(scope["method"], scope["path"])
                or scope.get(GRANTED) is True):
            await self.app(scope, receive, send)
            return
        if key_matches(_presented(scope["path"], dict(scope["headers"])), self._key):
            await self.app(scope, receive, send)
            return
        await send_refusal(send, 401, _refusal(scope["path"]))
