"""Server-sent events, and the rule that a response's end, however it comes, aborts the
engine requests it still holds.

A client that disconnects has its handler cancelled wherever it is (DisconnectAbortMiddleware,
kserve_paged/middleware.py); the cancellation reaches the engine through what is here: a
cancelled :func:`final_outputs` or :func:`merge` closes (aborts) every stream it reads, and
:class:`ClosingStreamingResponse` closes them however a streamed response ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kserve_paged.openai.errors import APIError
from kserve_paged_engine.frontend.async_llm import RequestStream
from kserve_paged_engine.outputs import RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = "data: [DONE]\n\n"


def sse(data: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    payload = (data.model_dump_json(exclude_unset=True) if isinstance(data, BaseModel)
               else json.dumps(data, separators=(",", ":")))
    return f"data: {payload}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator and the request streams however the response ends, so a
    vanished client's requests are aborted at once (Starlette cancels the body only on ASGI <
    2.4 servers, and an unstarted generator's finally never runs)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = streams

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            for stream in self._streams:
                stream.close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Run the streams to their final outputs; abort all of them if cancelled."""
    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        if final is None:
            raise APIError(500, "the request was aborted")
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for s in streams:
            s.close()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output), in arrival order."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()

