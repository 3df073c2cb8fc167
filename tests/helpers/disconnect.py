"""Clients that go away mid-request, and a count of the engine steps spent after they left.

`StepCounter` is a step callback (engine thread) that counts the engine's steps and, once
armed, calls a function at the N-th step from then. `leave_during` POSTs a body straight into
the ASGI app as uvicorn would (spec 2.3: the body, then `http.disconnect` when the client
closes) and disconnects at that step; `leave_during_on_loopback` does the same through a real
uvicorn and a socket that the client closes. Both return how many engine steps ran from the
disconnect until the engine had nothing left of the request: what a test bounds, rather than
a wall time.

The engine waits at the disconnect's step until the app has returned (at most
`SERVER_REACTION_S`): a tiny model steps far faster than the event loop thread gets the GIL,
so without the wait the count would measure the OS scheduler. A server that reacts has
returned and queued its aborts before the engine's next step; one that does not (the app
still waits on the engine) is let go after the wait, and its steps are counted.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kserve_paged.model import PagedLLMModel
from kserve_paged_engine.frontend.async_llm import StepInfo

SERVER_REACTION_S = 5.0  # the longest the engine waits at the disconnect for the app to end


@dataclass
class StepCounter:
    """Counts engine steps; `arm(n, fn)` calls `fn` (on the engine thread) at the n-th step
    from now, once, and records the count then in `fired_at`."""

    count: int = 0
    fired_at: int | None = None
    _at: int | None = None
    _fn: Callable[[], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, info: StepInfo) -> None:
        if not info.stepped:
            return
        with self._lock:
            self.count += 1
            fn = None
            if self._at is not None and self.count >= self._at:
                fn, self._fn, self._at = self._fn, None, None
                self.fired_at = self.count
        if fn is not None:
            fn()

    def arm(self, steps: int, fn: Callable[[], None]) -> None:
        """`fn` at the `steps`-th step from now; at once (here) when `steps` is 0."""
        with self._lock:
            self.fired_at = None
            self._at, self._fn = self.count + steps, fn
            if steps == 0:
                self._at, self._fn, self.fired_at = None, None, self.count
        if steps == 0:
            fn()


async def engine_idle(model: PagedLLMModel) -> bool:
    """True when the engine holds no request and no command is queued (asked on the engine
    thread, between steps, after every abort queued before this call)."""
    busy = await model.llm.call_engine(lambda engine: engine.has_unfinished_requests())
    return not busy and model.llm.num_unfinished == 0


def _scope(path: str, payload: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode())],
            "client": ("127.0.0.1", 50000), "server": ("t", 80)}


def _leave_then_wait(loop: asyncio.AbstractEventLoop, left: asyncio.Event,
                     returned: threading.Event) -> Callable[[], None]:
    """On the engine thread: the client leaves, and the engine waits for the app to end. (On
    the event loop's thread, before the request: the client leaves.)"""
    loop_thread = threading.get_ident()

    def fire() -> None:
        if threading.get_ident() == loop_thread:
            left.set()
            return
        loop.call_soon_threadsafe(left.set)
        returned.wait(SERVER_REACTION_S)
    return fire


async def leave_during(app: Any, model: PagedLLMModel, steps: StepCounter, path: str,
                       body: dict[str, Any], after_steps: int = 3) -> int:
    """POST `body` to `path`; the client disconnects at the engine's `after_steps`-th step
    from now (0: as soon as the body is sent). Returns the engine steps from the disconnect
    until the handler had returned and the engine was idle."""
    loop = asyncio.get_running_loop()
    left = asyncio.Event()
    payload = json.dumps(body).encode()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass  # nobody reads: uvicorn drops what is sent to a closed connection

    returned = threading.Event()
    steps.arm(after_steps, _leave_then_wait(loop, left, returned))
    try:
        await app(_scope(path, payload), receive, send)
    finally:
        returned.set()
    assert steps.fired_at is not None, "the request ended before the client left"
    while not await engine_idle(model):
        await asyncio.sleep(0.005)
    return steps.count - steps.fired_at


async def leave_during_on_loopback(app: Any, model: PagedLLMModel, steps: StepCounter,
                                   path: str, body: dict[str, Any], after_steps: int = 3
                                   ) -> int:
    """As `leave_during`, through a real uvicorn on 127.0.0.1 and a socket the client
    closes."""
    import uvicorn

    returned = threading.Event()

    async def observed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        finally:
            returned.set()

    server = uvicorn.Server(uvicorn.Config(observed, host="127.0.0.1", port=0, lifespan="off",
                                           log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        loop = asyncio.get_running_loop()
        left = asyncio.Event()
        steps.arm(after_steps, _leave_then_wait(loop, left, returned))
        await left.wait()
        writer.close()
        while not await engine_idle(model):
            await asyncio.sleep(0.005)
        assert steps.fired_at is not None
        return steps.count - steps.fired_at
    finally:
        server.should_exit = True
        await serving
