"""Request bodies -> validated pydantic bodies, prompts and conversations (400s in OpenAI's
shape for anything malformed, before any work is queued)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.schemas import SamplingBody

logger = logging.getLogger("kserve.paged.openai")

Body = TypeVar("Body", bound=SamplingBody)
Model = TypeVar("Model", bound=BaseModel)
# Bodies above this are decoded on a worker thread: decoding megabytes of JSON on the event loop
# would stall every other connection for as long.
DECODE_OFF_LOOP_BYTES = 256 << 10


def _decode(raw: bytes) -> Any:
    data = json.loads(raw) if raw else None
    # JSON may escape lone surrogates (\ud800), which no tokenizer takes: refuse them here.
    json.dumps(data, ensure_ascii=False).encode("utf-8")
    return data


async def read_json(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object; malformed JSON is a 400."""
    try:
        raw = await request.body()
        data = (await asyncio.to_thread(_decode, raw) if len(raw) > DECODE_OFF_LOOP_BYTES
                else _decode(raw))
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds invalid Unicode (a lone surrogate)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def validate(cls: type[Model], data: dict[str, Any]) -> Model:
    """`data` as `cls`: a bad field, or an option `cls.unsupported()` names, is a 400."""
    try:
        body = cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)) or None
        if param and "[" in param:
            param = param.split("[")[0]
        raise APIError(400, f"invalid request: {param}: {err.get('msg')}" if param
                       else f"invalid request: {err.get('msg')}", param=param) from None
    for param, message in getattr(body, "unsupported", list)():
        raise APIError(400, message, param=param, code="unsupported_parameter")
    return body


async def parse_body(request: Request, cls: type[Body]) -> Body:
    """The request's body as ``cls``; malformed JSON, bad fields and unsupported options are
    400s naming the field."""
    body = validate(cls, await read_json(request))
    if body.model_extra:
        # vLLM's behaviour, which OpenAI clients rely on (they send vendor extras): ignore
        # unknown fields, but leave a trace for the operator.
        logger.warning("ignoring unknown field(s) %s in %s", sorted(body.model_extra),
                       request.url.path)
    return body


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                  ) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts (text, or token ids). An empty list is one
    empty prompt, which the one prompt check (PagedLLMModel.encode) refuses."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def chat_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with plain-text content, as chat templates expect."""
    conversation = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"messages[{i}]: content part {kind!r} is not supported "
                                   "(text only)", param="messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text "
                           "parts", param="messages")
        conversation.append({**message, "content": content})
    return conversation


def conversation_chars(conversation: list[dict[str, Any]]) -> int:
    """Characters of all message contents: what the prompt-length limit is checked against
    before the chat template is applied."""
    return sum(len(m["content"]) for m in conversation)
