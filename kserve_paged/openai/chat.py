"""``POST /openai/v1/chat/completions``: the response whole or streamed (SSE chunks of deltas),
tool calls and a reasoning model's thinking split out (the turn itself: chat_turn.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)

from kserve_paged.logprobs import TokenText, chat_logprobs, prompt_logprobs_json
from kserve_paged.openai.chat_turn import split_turn, start_turn
from kserve_paged.openai.errors import APIError, error_body
from kserve_paged.openai.render import check_output, finish_reason, new_entries, total_usage
from kserve_paged.openai.schemas import ChatBody, ChatCompletionOut
from kserve_paged.openai.stream import (
    DONE_EVENT,
    ClosingStreamingResponse,
    final_outputs,
    sse,
)
from kserve_paged.openai.tools import StreamedCalls, ToolPlan, with_calls
from kserve_paged.openai.turn import TurnPiece, TurnStream
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import EngineDeadError, RequestStream
from kserve_paged_engine.outputs import RequestOutput


async def chat_completions(model: ServedModel, request: Request, body: ChatBody,
                           deadline: float | None = None) -> Response:
    """Chat completions: ``n`` choices, ``logprobs``/``top_logprobs`` in OpenAI's chat shape,
    ``max_completion_tokens`` (see :class:`ChatBody`); with a reasoning parser, the thinking
    in ``message.reasoning`` (and vLLM's older ``reasoning_content``). ``deadline``: the
    request's (admission.py)."""
    name = body.model or model.name
    turn = await start_turn(model, request, body, "chatcmpl", deadline)
    streams, plan = turn.streams, turn.plan
    # Tokens' text is for logprobs alone: without them logprobs.py has no part.
    token_text = (TokenText(model.info.tokenizer) if body.top_logprobs_k() is not None
                  else None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStreamingResponse(
            stream_chat(streams[0], rid, created, name, include_usage, body, token_text, plan,
                        turn.reasoning_parser),
            streams)
    finals = await final_outputs(streams)
    result = _whole(finals, rid, created, name, body, token_text, plan, turn.reasoning_parser)
    return JSONResponse(result.model_dump(mode="json", exclude_unset=True))


def _whole(finals: list[RequestOutput], rid: str, created: int, name: str, body: ChatBody,
           token_text: TokenText | None, plan: ToolPlan | None,
           parser: str | None = None) -> ChatCompletionOut:
    """The response of a request that does not stream: every choice's message (tool calls
    parsed out of its text), logprobs and finish reason."""
    out = finals[0]
    check_output(out)
    k = body.top_logprobs_k()
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        logprobs = None
        if k is not None:
            ids, entries = new_entries(c, delta=False)
            logprobs = {"content": chat_logprobs(ids, entries, k, token_text)}
        reasoning, content, calls = split_turn(c.text, plan, parser)
        reason = finish_reason(c) or "stop"
        extra: dict[str, Any] = {"tool_calls": [call.to_openai() for call in calls]} if calls else {}
        if parser:
            extra.update(reasoning=reasoning, reasoning_content=reasoning)
        choices.append(ChatChoice(
            index=c.index, finish_reason=with_calls(reason, calls), logprobs=logprobs,
            message=ChatCompletionMessage(role="assistant", content=content, **extra)))
    more = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
            if body.prompt_logprobs is not None else {})
    return ChatCompletionOut(id=rid, object="chat.completion", created=created, model=name,
                             choices=choices, usage=total_usage(finals), **more)


@dataclass(slots=True)
class _ChatStream:
    """A streamed chat response's state: which choices have ended, each choice's tool calls
    so far, and whether the prompt logprobs still ride on the next chunk (vLLM's place for
    them: the first chunk with generated content)."""

    rid: str
    created: int
    model: str
    k: int | None
    token_text: TokenText | None  # with logprobs (k) only
    plan: ToolPlan | None
    calls: dict[int, StreamedCalls]
    prompt_pending: bool
    done: set[int] = field(default_factory=set)
    turns: dict[int, TurnStream] = field(default_factory=dict)  # with a reasoning parser

    def chunk(self, index: int | None, delta: ChoiceDelta | None = None,
              reason: str | None = None, logprobs: list[dict[str, Any]] | None = None,
              **extra: Any) -> ChatCompletionChunk:
        choices = [] if index is None else [ChunkChoice(
            index=index, delta=delta or ChoiceDelta(), finish_reason=reason,
            logprobs=None if logprobs is None else {"content": logprobs})]
        return ChatCompletionChunk(id=self.rid, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices,
                                   **extra)

    def chunks_of(self, out: RequestOutput) -> Iterator[ChatCompletionChunk]:
        """One output's chunks: per choice that changed, its text delta (or, with tools, the
        tool-call deltas found in its text so far), logprobs and finish reason."""
        for c in out.outputs:
            if c.index in self.done:
                continue
            reason = finish_reason(c)
            logprobs = None
            if self.k is not None:
                ids, entries = new_entries(c, delta=True)
                logprobs = chat_logprobs(ids, entries, self.k, self.token_text)
            if not c.delta_text and reason is None and not logprobs:
                continue
            if reason is not None:
                self.done.add(c.index)
            extra = {}
            if self.prompt_pending:
                extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                self.prompt_pending = False
            if self.plan is None and not self.turns:
                yield self.chunk(c.index, ChoiceDelta(content=c.delta_text), reason, logprobs,
                                 **extra)
                continue
            if self.turns:
                turn = self.turns[c.index]
                deltas = [_piece_delta(p) for p in turn.feed(c.delta_text, reason is not None)]
                if reason is not None:
                    reason = turn.finish_reason(reason)
            else:
                calls = self.calls[c.index]
                deltas = calls.feed(c.text, finished=reason is not None)
                if reason is not None:
                    reason = with_calls(reason, calls.calls)
            if not deltas:
                deltas = [ChoiceDelta()]
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                yield self.chunk(c.index, delta, reason if last else None,
                                 logprobs if last else None, **(extra if j == 0 else {}))


def _piece_delta(piece: TurnPiece) -> ChoiceDelta:
    """A turn piece (openai/turn.py) as a chat delta: reasoning in vLLM's `reasoning` (and
    its older `reasoning_content`), answer text, tool-call parts."""
    fields: dict[str, Any] = {}
    if piece.reasoning:
        fields.update(reasoning=piece.reasoning, reasoning_content=piece.reasoning)
    if piece.content:
        fields["content"] = piece.content
    if piece.calls:
        fields["tool_calls"] = [ChoiceDeltaToolCall(
            index=call.index, id=call.id, type="function" if call.id else None,
            function=ChoiceDeltaToolCallFunction(name=call.name, arguments=call.arguments))
            for call in piece.calls]
    return ChoiceDelta(**fields)


async def stream_chat(stream: RequestStream, rid: str, created: int, model: str,
                      include_usage: bool, body: ChatBody, token_text: TokenText | None,
                      plan: ToolPlan | None = None, parser: str | None = None
                      ) -> AsyncIterator[str]:
    """The chat response as server-sent events: a role chunk per choice, then each output's
    chunks, usage if asked, and ``[DONE]``."""
    state = _ChatStream(rid, created, model, body.top_logprobs_k(), token_text, plan,
                        {index: StreamedCalls(plan) for index in range(body.n)} if plan else {},
                        body.prompt_logprobs is not None,
                        turns={index: TurnStream(plan, parser) for index in range(body.n)}
                        if parser else {})
    final: RequestOutput | None = None
    try:
        for index in range(body.n):
            yield sse(state.chunk(index, ChoiceDelta(role="assistant", content="")))
        async for out in stream:
            check_output(out)
            if out.finished:
                final = out
            for piece in state.chunks_of(out):
                yield sse(piece)
        if include_usage and final is not None:
            last = state.chunk(None)
            last.usage = total_usage([final])
            yield sse(last)
    except APIError as exc:
        yield sse(error_body(exc.message, exc.type, exc.param, exc.code))
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    finally:
        stream.close()
    yield DONE_EVENT
