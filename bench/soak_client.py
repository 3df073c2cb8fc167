"""Sends one soak request and says what came of it: its status, its answer, and whether it
finished (a non-streamed body with every choice's finish_reason, or a stream that ended in
[DONE] without an error event).

Answers are normalised so a streamed request and the same request not streamed compare equal:
a list with one string per choice (text, message content, or the tool calls as JSON).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from soak_requests import Spec

# What came of a request (Outcome.result).
FINISHED = "finished"  # 2xx and a complete answer
REFUSED = "refused"  # 4xx
SERVER_ERROR = "server_error"  # 5xx
STREAM_ERROR = "stream_error"  # 200, then an error event in the stream
INCOMPLETE = "incomplete"  # 200 but no [DONE], or a choice without finish_reason
DISCONNECTED = "disconnected"  # we closed it on purpose
TIMEOUT = "timeout"  # no answer within the client timeout: a hung request
CONN_ERROR = "conn_error"  # the connection failed


@dataclass
class Outcome:
    kind: str
    variant: int
    route: str
    stream: bool
    t_send: float
    t_end: float = 0.0
    status: int | None = None
    result: str = INCOMPLETE
    answer: list[str] | None = None
    error: str | None = None
    adapter: str | None = None
    ref_key: str = ""
    ref_repeat: int = 1
    compare: str | None = None
    expect: int = 200
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (usage)


def _chat_answer(content: str | None, calls: list[tuple[str, str]]) -> str:
    return json.dumps(calls) if calls else (content or "")


def answer_of(route: str, body: dict[str, Any]) -> tuple[list[str], bool]:
    """(answer, every choice finished) of a non-streamed 200 body."""
    if "outputs" in body:  # v2
        out = next(o for o in body["outputs"] if o["name"] == "text_output")
        return [str(x) for x in out["data"]], True
    choices = sorted(body["choices"], key=lambda c: c["index"])
    done = all(c.get("finish_reason") for c in choices)
    if route.endswith("/chat/completions"):
        answers = []
        for c in choices:
            msg = c["message"]
            calls = [(t["function"]["name"], t["function"]["arguments"])
                     for t in msg.get("tool_calls") or []]
            answers.append(_chat_answer(msg.get("content"), calls))
        return answers, done
    return [c["text"] for c in choices], done


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """Prompt tokens the prefix cache served, from an OpenAI usage object (None: not said)."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


class StreamAssembler:
    """Builds the answer of an SSE stream from its events, in the non-streamed form."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text: dict[int, str] = {}
        self.calls: dict[int, dict[int, list[str]]] = {}  # choice -> call index -> [name, args]
        self.finished: set[int] = set()
        self.done = False
        self.error: str | None = None
        self.events = 0
        self.usage: dict[str, Any] = {}

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        event = json.loads(payload)
        self.events += 1
        if event.get("usage"):
            self.usage = event["usage"]
        if "error" in event:
            self.error = json.dumps(event["error"])[:300]
            return
        for c in event.get("choices") or []:
            i = c["index"]
            self.text.setdefault(i, "")
            if c.get("finish_reason"):
                self.finished.add(i)
            if not self.chat:
                self.text[i] += c.get("text") or ""
                continue
            delta = c.get("delta") or {}
            self.text[i] += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                call = self.calls.setdefault(i, {}).setdefault(d["index"], ["", ""])
                fn = d.get("function") or {}
                call[0] += fn.get("name") or ""
                call[1] += fn.get("arguments") or ""

    def answer(self) -> list[str]:
        out = []
        for i in sorted(self.text):
            calls = [tuple(self.calls[i][k]) for k in sorted(self.calls.get(i, {}))]
            out.append(_chat_answer(self.text[i], calls) if self.chat else self.text[i])
        return out

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and set(self.text) <= self.finished


async def send(session: aiohttp.ClientSession, base_url: str, spec: Spec,
               timeout_s: float) -> Outcome:
    """Send `spec` and classify what came back; never raises for the server's behaviour."""
    out = Outcome(spec.kind, spec.variant, spec.route, spec.stream, time.monotonic(),
                  adapter=spec.adapter, ref_key=spec.ref_key, ref_repeat=spec.ref_repeat,
                  compare=spec.compare, expect=spec.expect)
    limit = spec.abandon_after_s if spec.abandon_after_s is not None else timeout_s
    try:
        await asyncio.wait_for(_exchange(session, base_url + spec.route, spec, out), limit)
    except asyncio.TimeoutError:
        if spec.abandon_after_s is not None:
            out.result = DISCONNECTED
        else:
            out.result, out.error = TIMEOUT, f"no answer within {timeout_s:.0f} s"
    except (aiohttp.ClientError, ConnectionError, ValueError, KeyError, TypeError) as exc:
        out.result, out.error = CONN_ERROR, f"{type(exc).__name__}: {exc}"[:300]
    out.t_end = time.monotonic()
    return out


async def _exchange(session: aiohttp.ClientSession, url: str, spec: Spec, out: Outcome) -> None:
    kw: dict[str, Any] = ({"data": spec.body, "headers": {"content-type": "application/json"}}
                          if isinstance(spec.body, bytes) else {"json": spec.body})
    async with session.post(url, **kw) as resp:
        out.status = resp.status
        if resp.status >= 300:
            text = await resp.text()
            out.result = SERVER_ERROR if resp.status >= 500 else REFUSED
            out.error = text[:300]
            return
        if not spec.stream:
            raw = await resp.read()
            if spec.route.endswith("_adapter"):  # load / unload: a plain-text answer
                out.result, out.answer = FINISHED, [raw.decode(errors="replace")]
                return
            body = json.loads(raw)
            out.answer, complete = answer_of(spec.route, body)
            out.result = FINISHED if complete else INCOMPLETE
            out.cached_tokens = cached_tokens(body.get("usage"))
            return
        sse = StreamAssembler(chat=spec.route.endswith("/chat/completions"))
        async for raw_line in resp.content:
            sse.feed(raw_line.decode(errors="replace").strip())
            if spec.disconnect_after_chunks is not None and \
                    sse.events >= spec.disconnect_after_chunks:
                resp.close()  # drop the connection mid-stream: the server must abort
                out.result = DISCONNECTED
                return
        out.answer = sse.answer()
        out.error = sse.error
        out.cached_tokens = cached_tokens(sse.usage)
        out.result = (FINISHED if sse.complete else STREAM_ERROR if sse.error else INCOMPLETE)
