"""Pure ASGI middleware of the server: what KServe's routes need before they see a request.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses pass through untouched.
Order on the app (outermost first): size limit, Content-Type, binary v2 guard, disconnects.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

from kserve_paged.openai.errors import error_body

INFERENCE_HEADER = b"inference-header-content-length"
FORM = b"application/x-www-form-urlencoded"
# OpenAI routes (and their vLLM-path aliases, openai/handlers.py): errors in OpenAI's shape.
OPENAI_PATH_PREFIX = ("/openai/", "/v1/completions", "/v1/chat/completions")
# POSTs that change the server's state (KServe's repository load/unload, LoRA adapters'
# routes): DisconnectAbortMiddleware lets them finish. Every other POST is inference.
STATE_CHANGE_PATH_ENDS = ("/load", "/unload", "_lora_adapter")
# A body this many times over the limit is not read to its end before the 413 (the connection
# closes instead): reading it would cost more than a client that sends it deserves.
_DRAIN_FACTOR = 8


class RequestSizeLimitMiddleware:
    """Refuses a POST body over ``max_bytes`` with 413 before anything buffers or parses it.

    Why: a huge prompt would be read, parsed and tokenized before being found too long, and
    meanwhile every other request waits. A declared ``Content-Length`` is checked at once; a
    chunked body is counted as it arrives (and replayed to the app when it fits). A body over
    the limit is still read (not kept) up to ``_DRAIN_FACTOR`` times the limit, so the client,
    still sending, gets the 413 instead of a reset connection."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                if declared <= self.max_bytes * _DRAIN_FACTOR:
                    await _drain(receive)
                await self._refuse(scope, send, declared)
                return
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                if message.get("more_body", False):
                    size += await _drain(receive, self.max_bytes * _DRAIN_FACTOR - size)
                await self._refuse(scope, send, size)
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict[str, Any], send: Any, size: int) -> None:
        message = (f"the request body has {size} bytes, more than this server accepts "
                   f"({self.max_bytes}, --max_request_bytes)")
        content = (error_body(message, "invalid_request_error", code="request_too_large")
                   if scope.get("path", "").startswith(OPENAI_PATH_PREFIX)
                   else {"error": message})
        await _send_json(send, 413, content)


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Any, budget: int | None = None) -> int:
    """Read (and drop) the rest of a body, up to ``budget`` bytes; how many were read."""
    read = 0
    while budget is None or read <= budget:
        message = await receive()
        if message["type"] != "http.request":
            break
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return read


class V2ContentTypeMiddleware:
    """tritonclient.http posts v2 requests without Content-Type, which FastAPI >= 0.132 refuses
    (docs/kserve.md). Supply it when absent: binary requests announce their JSON part with
    ``Inference-Header-Content-Length``, everything else is JSON. Pure ASGI, so streaming
    responses pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = list(scope.get("headers") or [])
            types = [value for name, value in headers if name.lower() == b"content-type"]
            # curl -d sends form encoding, which no v2 body ever is: treat it as missing.
            form = (bool(types) and types[0].startswith(FORM)
                    and scope.get("path", "").endswith("/infer"))
            if not types or form:
                names = {name.lower() for name, _ in headers}
                kind = (b"application/octet-stream" if INFERENCE_HEADER in names
                        else b"application/json")
                headers = [(n, v) for n, v in headers if n.lower() != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", kind)]}
        await self.app(scope, receive, send)


class DisconnectAbortMiddleware:
    """Cancels a request's handler when its client goes away, on every inference route.

    Starlette does not cancel a running handler on disconnect, and KServe's ``predict`` never
    sees the request, so without this an abandoned call keeps the engine busy: each prompt of a
    multi-prompt request still being tokenized and submitted, then generating up to its
    ``max_tokens``. The middleware reads the body first, replays it to the app, and meanwhile
    listens for ``http.disconnect``; on one it cancels the handler wherever it is (tokenizing,
    submitting, waiting, streaming), which aborts every engine request it opened and the one it
    was submitting (freed within an engine step). POSTs that change the server's state
    (``STATE_CHANGE_PATH_ENDS``) are left to finish, so a departing client cannot leave an
    adapter or a model half loaded.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope.get("method") != "POST" or path.endswith(STATE_CHANGE_PATH_ENDS):
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            messages.append(message)
            if not message.get("more_body", False):
                break
        client_left = asyncio.Event()
        answered = False  # the last body byte went out: a later disconnect is the server's

        async def replay() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await client_left.wait()  # the app asks again only to watch for a disconnect
            return {"type": "http.disconnect"}

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True  # before the send: the server may report the end meanwhile
            await send(message)

        handler = asyncio.ensure_future(self.app(scope, replay, tracked_send))

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not answered:  # uvicorn reports a completed response as a disconnect too
                client_left.set()
                handler.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not client_left.is_set():
                handler.cancel()  # cancelled from outside (shutdown): the handler goes too
                raise
        finally:
            watcher.cancel()


class V2BinaryGuardMiddleware:
    """Checks binary v2 bodies (``Inference-Header-Content-Length``) before KServe parses them.

    KServe 0.21 answers a malformed binary body with a 500 (``struct.error`` for a truncated
    tensor, which also resets the next request on that connection; ``InferenceError`` for BYTES
    that are not UTF-8). Those are the client's errors: answer 400 with a message instead.
    The body's size is bounded by :class:`RequestSizeLimitMiddleware`, which runs first."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").endswith("/infer")):
            await self.app(scope, receive, send)
            return
        header = next((v for n, v in scope.get("headers") or [] if n.lower() == INFERENCE_HEADER),
                      None)
        if header is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = binary_v2_problem(body, header)
        if problem is not None:
            await _send_json(send, 400, {"error": problem})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def binary_v2_problem(body: bytes, header_length: bytes) -> str | None:
    """Why a binary v2 body is malformed, or None if KServe can parse it."""
    try:
        json_length = int(header_length)
    except ValueError:
        return f"Inference-Header-Content-Length must be an integer (got {header_length!r})"
    if not 0 < json_length <= len(body):
        return (f"Inference-Header-Content-Length {json_length} does not fit the body "
                f"({len(body)} bytes)")
    try:
        request = json.loads(body[:json_length])
    except (ValueError, RecursionError) as exc:
        return f"the JSON header of the binary request is not valid JSON: {exc}"
    inputs = request.get("inputs") if isinstance(request, dict) else None
    if not isinstance(inputs, list):
        return 'the JSON header needs an "inputs" list'
    offset = json_length
    for tensor in inputs:
        if not isinstance(tensor, dict):
            return "each input must be an object"
        params = tensor.get("parameters")
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is None:
            continue
        name = tensor.get("name")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"input {name!r}: binary_data_size must be a non-negative integer"
        if offset + size > len(body):
            return (f"input {name!r}: binary_data_size {size} runs past the end of the body "
                    f"({len(body) - offset} bytes left)")
        if tensor.get("datatype") == "BYTES":
            data, pos = body[offset:offset + size], 0
            while pos < size:
                if pos + 4 > size:
                    return f"input {name!r}: truncated BYTES element length"
                length = struct.unpack_from("<I", data, pos)[0]
                pos += 4
                if pos + length > size:
                    return f"input {name!r}: a BYTES element runs past binary_data_size"
                try:
                    data[pos:pos + length].decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"input {name!r} is not valid UTF-8 text: {exc}"
                pos += length
        offset += size
    return None


async def _send_json(send: Any, status: int, content: dict[str, Any]) -> None:
    payload = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class V2VersionGuardMiddleware:
    """KServe answers a v2 request naming a model version (``/versions/V`` in the path or a
    ``model_version`` query) with 501 "not supported yet": a server error for what is the
    client's choice. Served models have no versions, so answer 400 with v2's error shape."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v2/models/") and (
                "/versions/" in path or b"model_version=" in scope.get("query_string", b"")):
            body = json.dumps({"error": "model versions are not supported: served models have "
                                        "none (leave out /versions/... and model_version)"})
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await self.app(scope, receive, send)
