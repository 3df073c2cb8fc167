"""``POST /v1/responses`` (OpenAI's Responses API, stateless): the request becomes a chat turn
(responses_convert.py), runs through the chat path (chat_turn.py), and its output comes back
as Response items, whole or as the Responses events (responses_stream.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kserve_paged.openai.chat_turn import ChatTurn, split_turn, start_turn
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.render import finish_reason
from kserve_paged.openai.responses_convert import (
    ResponsesBody,
    chat_request,
    function_call_item,
    message_item,
    new_id,
    now,
    reasoning_item,
    response_object,
    status_of,
    usage_object,
)
from kserve_paged.openai.responses_stream import ResponseBuilder, ResponsesEvents
from kserve_paged.openai.schemas import ChatBody, validate
from kserve_paged.openai.stream import ClosingStreamingResponse
from kserve_paged.openai.turn_feed import TurnFeed, failure_message, whole_output
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import EngineDeadError
from kserve_paged_engine.outputs import CompletionOutput, RequestOutput


def parse_responses(data: dict[str, Any]) -> tuple[ResponsesBody, ChatBody]:
    """The Responses body and the chat request it is; every refusal a 400 naming the field."""
    body = validate(ResponsesBody, data)
    return body, validate(ChatBody, chat_request(body))


def _usage(model: ServedModel, out: RequestOutput, reasoning: str | None) -> dict[str, Any]:
    c = out.outputs[0]
    thought = (len(model.info.tokenizer.encode(reasoning, add_special_tokens=False))
               if reasoning else 0)
    return usage_object(len(out.prompt_token_ids), len(c.token_ids),
                        min(thought, len(c.token_ids)), out.num_cached_tokens)


def _items(c: CompletionOutput, turn: ChatTurn) -> tuple[list[dict[str, Any]], str | None]:
    """A finished output's Response items (reasoning, message, function calls) and its
    reasoning text."""
    reasoning, content, calls = split_turn(c.text, turn.plan, turn.reasoning_parser)
    items = [reasoning_item(reasoning)] if reasoning else []
    if content:
        items.append(message_item(content))
    items.extend(function_call_item(call.id, call.name, call.arguments) for call in calls)
    return items, reasoning


async def create_response(model: ServedModel, request: Request, body: ResponsesBody,
                          chat: ChatBody, deadline: float | None = None) -> Response:
    """The Response, whole or as events; ``deadline``: the request's (admission.py)."""
    turn = await start_turn(model, request, chat, "resp", deadline)
    name, rid, created = body.model or model.name, new_id("resp"), now()

    def build(output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
              reason: str | None) -> dict[str, Any]:
        return response_object(body, response_id=rid, model=name, created=created,
                               output=output, status=status, usage=usage,
                               incomplete_reason=reason)

    if body.stream:
        return ClosingStreamingResponse(_events(model, turn, build), turn.streams)
    out = await whole_output(turn)
    items, reasoning = _items(out.outputs[0], turn)
    status, reason = status_of(finish_reason(out.outputs[0]))
    return JSONResponse(build(items, status, _usage(model, out, reasoning), reason))


async def _events(model: ServedModel, turn: ChatTurn, build: ResponseBuilder
                  ) -> AsyncIterator[str]:
    """The streamed Response: created, each piece's item events, completed (or incomplete);
    a failure mid-stream is an `error` event."""
    events = ResponsesEvents(build)
    feed = TurnFeed(turn)
    try:
        for text in events.start():
            yield text
        async for piece in feed.pieces():
            for text in events.piece(piece):
                yield text
        final = feed.final
        assert final is not None  # pieces() raises otherwise
        status, reason = status_of(finish_reason(final.outputs[0]))
        for text in events.finish(status, _usage(model, final, feed.split.reasoning or None),
                                  reason):
            yield text
    except (APIError, EngineDeadError) as exc:
        yield events.error(failure_message(exc))
    finally:
        feed.close()
