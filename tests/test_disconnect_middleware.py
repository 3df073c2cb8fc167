"""DisconnectAbortMiddleware on its own, around a stand-in app: a client that leaves cancels
an inference handler wherever it waits; a POST that changes the server's state (adapters,
KServe's repository) finishes anyway; and the disconnect a server reports once the response
is complete does not cut short what the handler does after its last byte. (With real engines
on every route: test_disconnect_abort.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kserve_paged.middleware import DisconnectAbortMiddleware


def _scope(path: str) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": []}


class StandIn:
    """An ASGI app that reads the body, waits on `release` (a handler submitting prompts or
    loading an adapter), answers, then does a little more work after its last byte."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.events: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        try:
            await self.release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})
            for _ in range(3):
                await asyncio.sleep(0)  # the handler's own cleanup after its answer
            self.events.append("finished")
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise


async def _call(path: str, leave_first: bool) -> tuple[StandIn, list[dict[str, Any]]]:
    """Call the middleware; the client leaves before the app answers (`leave_first`), or,
    as uvicorn reports it, once the response is complete."""
    app, sent = StandIn(), []
    answered = asyncio.Event()
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if not leave_first:
            await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    task = asyncio.ensure_future(DisconnectAbortMiddleware(app)(_scope(path), receive, send))
    for _ in range(10):
        await asyncio.sleep(0)
    app.release.set()
    await asyncio.wait_for(task, 10)
    return app, sent


@pytest.mark.parametrize("path", ["/v1/completions", "/openai/v1/chat/completions",
                                  "/v1/messages", "/v1/embeddings", "/rerank",
                                  "/v2/models/m/infer", "/v1/models/m:predict"])
def test_a_client_leaving_cancels_an_inference_handler(path: str):
    app, sent = asyncio.run(_call(path, leave_first=True))
    assert app.events == ["cancelled"] and sent == []


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/openai/v1/unload_lora_adapter",
                                  "/v2/repository/models/m/load",
                                  "/v2/repository/models/m/unload"])
def test_a_state_changing_post_finishes_when_its_client_leaves(path: str):
    app, sent = asyncio.run(_call(path, leave_first=True))
    assert app.events == ["finished"] and sent[-1]["body"] == b"ok"


def test_the_end_of_a_complete_response_is_not_a_client_leaving():
    """uvicorn's receive() says `http.disconnect` once the last byte went out; the handler's
    work after that byte is not cancelled."""
    app, sent = asyncio.run(_call("/v1/completions", leave_first=False))
    assert app.events == ["finished"] and sent[-1]["body"] == b"ok"
