"""vLLM's tokenizer routes, ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes ``{"model"?, "prompt"}`` or ``{"model"?, "messages"}`` (chat messages,
rendered by the model's chat template as the chat route renders them) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``add_special_tokens`` defaults to true
for a prompt and false for messages (the template writes them), as in vLLM.
``/detokenize`` takes ``{"model"?, "tokens": [ids]}`` and answers ``{"prompt": text}``.
Malformed bodies, both or neither of prompt and messages, and ids outside the vocabulary are
400s before the tokenizer runs; tokenizing and the template run on a worker thread. Messages
are held to the chat route's rules: the server's --default_chat_template_kwargs under the
request's, no client-given template (``chat_template``, top level or in
``chat_template_kwargs``: a 400, as on chat), tools checked and capped as chat checks them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt

from kserve_paged.openai.chat_turn import (
    chat_conversation,
    conversation_chars,
    fallback_template,
    template_kwargs,
)
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.schemas import CHAT_UNSUPPORTED, ChatBody, validate
from kserve_paged.openai.tools import checked_tools, template_messages
from kserve_paged.request_options import OptionError, unsupported_options
from kserve_paged.served import ServedModel
from kserve_paged_engine import limits


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:  # parse_body's hook: nothing refused
        return []


class TokenizeBody(_Body):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """What chat refuses among its extras (a client's own ``chat_template``, ...)."""
        return [(name, f"{name} is not supported by this server") for name in
                unsupported_options(self.model_extra or {}, CHAT_UNSUPPORTED,
                                    check_best_of=False)]


class DetokenizeBody(_Body):
    tokens: list[StrictInt]


async def tokenize(model: ServedModel, body: TokenizeBody) -> JSONResponse:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.continue_final_message and body.add_generation_prompt and body.messages:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                       "be true", param="continue_final_message")
    info = model.info
    if body.messages is not None:
        text = await _render(model, body)
        special = bool(body.add_special_tokens)  # the template wrote them
    else:
        text = body.prompt or ""
        _check_chars(model, len(text), "prompt")
        special = body.add_special_tokens is not False
    ids = list(await asyncio.to_thread(info.tokenizer.encode, text,
                                       add_special_tokens=special))
    strs = None
    if body.return_token_strs:
        strs = await asyncio.to_thread(
            lambda: [info.tokenizer.decode([i], skip_special_tokens=False) for i in ids])
    return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len,
                         "tokens": ids, "token_strs": strs})


async def detokenize(model: ServedModel, body: DetokenizeBody) -> JSONResponse:
    info = model.info
    if body.tokens:
        try:
            limits.check_prompt_ids(body.tokens, info.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None
    text = await asyncio.to_thread(info.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


def _check_chars(model: ServedModel, num_chars: int, param: str) -> None:
    try:
        model.check_prompt_chars(num_chars, param)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


async def _render(model: ServedModel, body: TokenizeBody) -> str:
    """The messages through the chat template, as the chat route renders them (its template
    kwargs, tool and length rules)."""
    info = model.info
    extra = fallback_template(model, "tokenize a prompt instead")
    chat = validate(ChatBody, {"messages": body.messages,
                               "chat_template_kwargs": body.chat_template_kwargs})
    extra.update(template_kwargs(model, chat))
    if body.tools:  # as chat: no tools, no tools argument
        extra["tools"] = checked_tools(body.tools)
    conversation = template_messages(chat_conversation(body.messages or []))
    _check_chars(model, conversation_chars(conversation), "messages")
    try:
        return await asyncio.to_thread(
            info.tokenizer.apply_chat_template, conversation, tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, **extra)
    except Exception as exc:  # template errors are the request's fault (bad roles, ...)
        raise APIError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from None
