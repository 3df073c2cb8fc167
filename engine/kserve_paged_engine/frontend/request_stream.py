"""One request's outputs on the event loop: the channel the engine thread feeds, and the async
iterator a server reads (`engine/kserve_paged_engine/frontend/async_llm.py` says how the two threads hand items over)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from kserve_paged_engine.outputs import CompletionOutput, RequestOutput

END = object()  # stream sentinel: the request was aborted, end iteration


class Stream:
    """One request's output channel, owned by the event loop that called generate()."""

    __slots__ = ("request_id", "loop", "queue", "finished")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False  # set on the event loop once the final item was consumed

    def put(self, item: Any) -> None:
        """Engine thread -> event loop; a closed loop means nobody listens any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one accepted request, as an async iterator.

    Stopping early aborts the request: on cancellation inside ``__anext__``, on ``close()`` /
    ``aclose()``, and as a last resort when the object is garbage-collected unfinished.

    With a ``deadline`` (``time.monotonic()``), the request is aborted when it passes, wherever
    it is, and the stream ends with an error output (``error_status`` 408); ``on_deadline``
    is called then."""

    def __init__(self, abort: Callable[[list[str]], None], stream: Stream,
                 deadline: float | None = None,
                 on_deadline: Callable[[], None] | None = None) -> None:
        self._abort = abort  # the engine's non-blocking abort
        self._stream = stream
        self.deadline = deadline
        self._on_deadline = on_deadline

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        stream = self._stream
        if stream.finished:
            raise StopAsyncIteration
        try:
            if self.deadline is None or not stream.queue.empty():
                item = await stream.queue.get()
            else:
                item = await asyncio.wait_for(stream.queue.get(),
                                              max(self.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return self._timed_out()
        except BaseException:
            self.close()
            raise
        if item is END:
            stream.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            stream.finished = True
            raise item
        if item.finished:
            stream.finished = True
        return item

    def _timed_out(self) -> RequestOutput:
        """Abort at the deadline; the last output says why (408)."""
        self.close()
        if self._on_deadline is not None:
            self._on_deadline()
        message = ("the request's deadline passed (timeout, x-request-timeout or "
                   "--request_timeout_s): it was aborted")
        return RequestOutput(self._stream.request_id, None, [],
                             [CompletionOutput(0, "", [], finish_reason="error")], True,
                             error=message, error_status=408)

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent, never blocks)."""
        if not self._stream.finished:
            self._stream.finished = True
            self._abort([self._stream.request_id])

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
