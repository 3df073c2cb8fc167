"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API):
the request becomes a chat turn (convert.py), runs through the chat path
(openai/chat_turn.py), and comes back as a Message, whole or as Anthropic's events
(stream.py). Every failure is answered in Anthropic's error shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from kserve.errors import ModelNotReady

from kserve_paged.admission import RequestRefused, route_deadline
from kserve_paged.anthropic.convert import (
    ERROR_TYPES,
    CountTokensBody,
    MessagesBody,
    chat_request,
    count_request,
    error_body,
    new_message_id,
    stop_reason,
)
from kserve_paged.anthropic.stream import MessageEvents, sse_event
from kserve_paged.openai.chat_turn import ChatTurn, render_prompt, split_turn, start_turn
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.openapi import sdk_operation_schema
from kserve_paged.openai.render import finish_reason
from kserve_paged.openai.schemas import ChatBody, read_json, validate
from kserve_paged.openai.stream import ClosingStreamingResponse
from kserve_paged.openai.tools import tool_plan
from kserve_paged.openai.turn import CallPiece, TurnPiece
from kserve_paged.openai.turn_feed import TurnFeed, failure_message, whole_output
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import EngineDeadError
from kserve_paged_engine.outputs import CompletionOutput

logger = logging.getLogger("kserve.paged.anthropic")

ModelLookup = Callable[[str | None], ServedModel]


def _stop(c: CompletionOutput, has_calls: bool, body: MessagesBody
          ) -> tuple[str, str | None]:
    return stop_reason(finish_reason(c), c.stop_reason, has_calls, body.stop_sequences)


async def create_message(model: ServedModel, request: Request, body: MessagesBody,
                         deadline: float | None = None) -> Response:
    """The Message, whole or as events; ``deadline``: the request's (admission.py)."""
    chat = validate(ChatBody, chat_request(body))
    turn = await start_turn(model, request, chat, "msg", deadline)
    events = MessageEvents(new_message_id(), body.model or model.name, turn.prompt_len)
    if body.stream:
        return ClosingStreamingResponse(_events(turn, events, body), turn.streams)
    out = await whole_output(turn)
    c = out.outputs[0]
    reasoning, content, calls = split_turn(c.text, turn.plan, turn.reasoning_parser)
    events.piece(TurnPiece(reasoning=reasoning or "", content=content or ""))
    for i, call in enumerate(calls):
        events.piece(TurnPiece(calls=[CallPiece(i, call.id, call.name, call.arguments)]))
    reason, sequence = _stop(c, bool(calls), body)
    events.finish(reason, sequence, len(c.token_ids))  # closes the last block
    return JSONResponse(events.message(reason, sequence, len(c.token_ids)))


async def _events(turn: ChatTurn, events: MessageEvents, body: MessagesBody
                  ) -> AsyncIterator[str]:
    """message_start, each piece's block events, message_delta and message_stop; a failure
    mid-stream is an `error` event."""
    feed = TurnFeed(turn)
    try:
        for text in events.start():
            yield text
        async for piece in feed.pieces():
            for text in events.piece(piece):
                yield text
        assert feed.final is not None  # pieces() raises otherwise
        c = feed.final.outputs[0]
        reason, sequence = _stop(c, bool(feed.split.calls), body)
        for text in events.finish(reason, sequence, len(c.token_ids)):
            yield text
    except (APIError, EngineDeadError) as exc:
        yield sse_event(error_body(failure_message(exc), "api_error"))
    finally:
        feed.close()


async def count_tokens(model: ServedModel, body: CountTokensBody) -> dict[str, int]:
    """The prompt's length in tokens as the chat template renders it (tools included)."""
    chat = validate(ChatBody, count_request(body))
    plan = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                     model.tool_call_parser)
    return {"input_tokens": len(await render_prompt(model, chat, plan))}


def _in_anthropic_shape(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Every failure in Anthropic's error shape, `{"type": "error", "error": {...}}`; a full
    waiting queue is a 429 with Retry-After (rate_limit_error), as on the OpenAI routes."""
    async def route(request: Request) -> Response:
        headers = None
        try:
            return await handler(request)
        except APIError as exc:
            status, message, headers = exc.status, exc.message, exc.headers
        except RequestRefused as exc:  # 429: the waiting queue is full (admission.py)
            status, message, headers = exc.status, str(exc), exc.headers
        except (ModelNotReady, EngineDeadError) as exc:
            status, message = 503, str(exc)
        except Exception as exc:
            logger.exception("Messages route failed")
            status, message = 500, f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(status_code=status, headers=headers,
                            content=error_body(message, ERROR_TYPES.get(status, "api_error")))
    route.__name__ = getattr(handler, "__name__", "route")
    return route


def register_messages_routes(app: FastAPI, lookup: ModelLookup, prefix: str = "/v1") -> None:
    """`/v1/messages` and `/v1/messages/count_tokens`, where vLLM serves them; `lookup`
    finds the served model a request names (an APIError when it cannot)."""
    async def messages(request: Request) -> Response:
        body = validate(MessagesBody, await read_json(request))
        return await create_message(lookup(body.model), request, body,
                                    route_deadline(request))

    async def count(request: Request) -> Response:
        body = validate(CountTokensBody, await read_json(request))
        return JSONResponse(await count_tokens(lookup(body.model), body))

    router = APIRouter(prefix=prefix, tags=["Anthropic"])
    router.add_api_route("/messages", _in_anthropic_shape(messages), methods=["POST"],
                         response_model=None, openapi_extra=sdk_operation_schema(
                             MessagesBody, "A Messages API message, or with stream=true its "
                             "events"))
    router.add_api_route("/messages/count_tokens", _in_anthropic_shape(count),
                         methods=["POST"], response_model=None,
                         openapi_extra=sdk_operation_schema(CountTokensBody,
                                                            '{"input_tokens": N}'))
    app.include_router(router)
