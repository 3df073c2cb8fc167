"""``POST /openai/v1/chat/completions``: the chat template, tool calls, and the response whole
or streamed (SSE chunks of deltas)."""

from __future__ import annotations

import asyncio
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
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from engine.async_llm import EngineDeadError, RequestStream
from engine.outputs import RequestOutput
from kserve_paged.logprobs import TokenText, chat_logprobs, prompt_logprobs_json
from kserve_paged.openai.errors import APIError, error_body
from kserve_paged.openai.parse import chat_conversation, conversation_chars
from kserve_paged.openai.render import check_output, finish_reason, new_entries, total_usage
from kserve_paged.openai.schemas import ChatBody, ChatCompletionOut
from kserve_paged.openai.stream import (
    DONE_EVENT,
    ClosingStreamingResponse,
    final_outputs,
    sse,
    until_disconnect,
)
from kserve_paged.openai.submit import open_streams
from kserve_paged.openai.tools import (
    StreamedCalls,
    ToolPlan,
    template_messages,
    tool_plan,
    with_calls,
)
from kserve_paged.sampling import OptionError
from kserve_paged.served import ServedModel


async def chat_completions(model: ServedModel, request: Request, body: ChatBody) -> Response:
    """Chat completions: ``n`` choices, ``logprobs``/``top_logprobs`` in OpenAI's chat shape,
    ``max_completion_tokens`` (see :class:`ChatBody`)."""
    name = body.model or model.name
    conversation = template_messages(chat_conversation(body.messages))
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                     model.tool_call_parser)
    prompt_ids = await _prompt_ids(model, body, conversation, plan)
    salt = body.cache_salt or request.headers.get("x-cache-salt")
    streams = await open_streams(model, [prompt_ids], body, body.output_budget, None, salt,
                                 "chatcmpl", constraint=plan.constraint() if plan else None)
    token_text = TokenText(model.info.tokenizer)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStreamingResponse(
            stream_chat(streams[0], rid, created, name, include_usage, body, token_text, plan),
            streams)
    finals = await until_disconnect(request, asyncio.ensure_future(final_outputs(streams)))
    if finals is None:
        return Response(status_code=499)
    result = _whole(finals, rid, created, name, body, token_text, plan)
    return JSONResponse(result.model_dump(mode="json", exclude_unset=True))


async def _prompt_ids(model: ServedModel, body: ChatBody, conversation: list[dict[str, Any]],
                     plan: ToolPlan | None) -> list[int]:
    """The messages through the chat template (tools passed to it) and the tokenizer, both on
    a worker thread; their length is checked before either sees them."""
    info = model.info
    if not info.has_chat_template:
        raise APIError(400, "this model has no chat template; use /completions",
                       param="messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                       "be true", param="continue_final_message")
    try:  # the length of the messages before the template and the tokenizer see them
        model.check_prompt_chars(conversation_chars(conversation), "messages")
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    try:
        text = await asyncio.to_thread(
            info.tokenizer.apply_chat_template, conversation, tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=plan.template_tools if plan else None)
    except Exception as exc:  # template errors are the request's fault (bad roles, ...)
        raise APIError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from None
    try:
        return await model.encode(text, add_special_tokens=False)
    except OptionError as exc:
        raise APIError(400, f"the messages render to an unusable prompt: {exc}",
                       param="messages") from None


def _whole(finals: list[RequestOutput], rid: str, created: int, name: str, body: ChatBody,
           token_text: TokenText, plan: ToolPlan | None) -> ChatCompletionOut:
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
        content, calls = plan.parse(c.text) if plan else (c.text, [])
        reason = finish_reason(c) or "stop"
        choices.append(ChatChoice(
            index=c.index, finish_reason=with_calls(reason, calls), logprobs=logprobs,
            message=ChatCompletionMessage(
                role="assistant", content=content,
                **({"tool_calls": [call.to_openai() for call in calls]} if calls else {}))))
    extra = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
             if body.prompt_logprobs is not None else {})
    return ChatCompletionOut(id=rid, object="chat.completion", created=created, model=name,
                             choices=choices, usage=total_usage(finals), **extra)


@dataclass(slots=True)
class _ChatStream:
    """A streamed chat response's state: which choices have ended, each choice's tool calls
    so far, and whether the prompt logprobs still ride on the next chunk (vLLM's place for
    them: the first chunk with generated content)."""

    rid: str
    created: int
    model: str
    k: int | None
    token_text: TokenText
    plan: ToolPlan | None
    calls: dict[int, StreamedCalls]
    prompt_pending: bool
    done: set[int] = field(default_factory=set)

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
            if self.plan is None:
                yield self.chunk(c.index, ChoiceDelta(content=c.delta_text), reason, logprobs,
                                 **extra)
                continue
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


async def stream_chat(stream: RequestStream, rid: str, created: int, model: str,
                      include_usage: bool, body: ChatBody, token_text: TokenText,
                      plan: ToolPlan | None = None) -> AsyncIterator[str]:
    """The chat response as server-sent events: a role chunk per choice, then each output's
    chunks, usage if asked, and ``[DONE]``."""
    state = _ChatStream(rid, created, model, body.top_logprobs_k(), token_text, plan,
                        {index: StreamedCalls(plan) for index in range(body.n)} if plan else {},
                        body.prompt_logprobs is not None)
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
