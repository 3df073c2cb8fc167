"""One chat turn from a ChatBody to engine streams, shared by chat completions, Responses and
Messages: the chat template (tools, `chat_template_kwargs` over the server's defaults), the
tokenizer, the tool plan, and, for a reasoning model, where a constraint may start.

Structured outputs and reasoning: a JSON schema (or a tool call's constraint) holds the answer,
not the thinking. The engine's grammar can wait (`StructuredOutputs.start_after_token_id`,
engine/kserve_paged_engine/sample/structured_output.py): it is inactive until the model samples the end-of-thinking
token, and holds from the next token on. When the prompt already closed the thinking (Qwen3 with
`enable_thinking` false), the grammar holds from the first token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.reasoning import END, START, split_reasoning
from kserve_paged.openai.schemas import ChatBody
from kserve_paged.openai.submission import submit_prompts
from kserve_paged.openai.tools import ToolCall, ToolPlan, template_messages, tool_plan
from kserve_paged.request_options import OptionError, SamplingRequest
from kserve_paged.served import ServedModel
from kserve_paged.structured import StructuredOptionError, structured_outputs_option
from kserve_paged_engine.frontend.async_llm import RequestStream

# apply_chat_template's own arguments: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "tokenizer_kwargs", "padding", "truncation", "max_length"})


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


@dataclass(slots=True)
class ChatTurn:
    """A submitted chat request: its streams, tool plan, reasoning parser, prompt length."""

    streams: list[RequestStream]
    plan: ToolPlan | None
    reasoning_parser: str | None
    prompt_len: int


def template_kwargs(model: ServedModel, body: ChatBody) -> dict[str, Any]:
    """The server's --default_chat_template_kwargs under the request's chat_template_kwargs."""
    given = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(given))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)} (the "
                       "request's own fields say that)", param="chat_template_kwargs")
    return {**model.default_chat_template_kwargs, **given}


async def render_prompt(model: ServedModel, body: ChatBody, plan: ToolPlan | None
                        ) -> list[int]:
    """The messages through the chat template (tools and template kwargs passed to it) and
    the tokenizer, both on a worker thread; their length is checked before either sees them."""
    info = model.info
    if not info.has_chat_template:
        raise APIError(400, "this model has no chat template; use /completions",
                       param="messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                       "be true", param="continue_final_message")
    conversation = chat_conversation(body.messages)
    if any("tool_calls" in message for message in conversation):  # else tools.py has no part
        conversation = template_messages(conversation)
    extra = template_kwargs(model, body)
    try:  # the length of the messages before the template and the tokenizer see them
        model.check_prompt_chars(conversation_chars(conversation), "messages")
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    try:
        text = await asyncio.to_thread(
            info.tokenizer.apply_chat_template, conversation, tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=plan.template_tools if plan else None, **extra)
    except Exception as exc:  # template errors are the request's fault (bad roles, ...)
        raise APIError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from None
    try:
        return await model.encode(text, add_special_tokens=False)
    except OptionError as exc:
        raise APIError(400, f"the messages render to an unusable prompt: {exc}",
                       param="messages") from None


def _single_token(tokenizer: Any, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def reasoning_gate(model: ServedModel, prompt_ids: list[int]) -> int | None:
    """The token a constraint waits for (the end of thinking), or None when the thinking is
    already over in the prompt (its last end tag comes after its last start tag)."""
    tokenizer = model.info.tokenizer
    start, end = _single_token(tokenizer, START), _single_token(tokenizer, END)
    if end is None:
        raise APIError(400, f"structured outputs with a reasoning parser need {END} to be one "
                       "token, and it is not one for this model", param="response_format")
    last_end = max((i for i, t in enumerate(prompt_ids) if t == end), default=-1)
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1)
    return None if last_end > last_start else end


def with_tools(options: SamplingRequest, plan: ToolPlan | None) -> SamplingRequest:
    """The request under its tools' own constraint (tool_choice "required" or a named
    function), which no other constraint may join."""
    constraint = plan.constraint() if plan else None
    if constraint is None:
        return options
    if options.structured is not None:
        raise APIError(400, "tool_choice \"required\" or a named function constrains the "
                       "output itself: it cannot be combined with response_format or "
                       "structured_outputs", param="tool_choice")
    try:
        structured = structured_outputs_option({"structured_outputs": constraint})
    except StructuredOptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return replace(options, structured=structured)


async def start_turn(model: ServedModel, request: Request, body: ChatBody, kind: str,
                     deadline: float | None = None) -> ChatTurn:
    """Check, render, tokenize and submit the body's turn, to be aborted at `deadline`
    (admission.py); every refusal is a 400 before the engine sees it, a bad option before
    the template renders."""
    plan = None
    if body.tools or body.tool_choice not in (None, "none"):  # else tools.py has no part
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                         model.tool_call_parser)
    try:
        options = with_tools(body.sampling_request(model.info.vocab_size), plan)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    prompt_ids = await render_prompt(model, body, plan)
    parser = model.reasoning_parser
    if parser and options.structured is not None:
        gate = reasoning_gate(model, prompt_ids)
        if gate is not None:
            options.structured.start_after_token_id = gate
    salt = body.cache_salt or request.headers.get("x-cache-salt")
    streams = await submit_prompts(model, [prompt_ids], options, kind=kind,
                                   priority=body.priority, cache_salt=salt, deadline=deadline)
    return ChatTurn(streams, plan, parser, len(prompt_ids))


def split_turn(text: str, plan: ToolPlan | None, parser: str | None
               ) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole output's (reasoning, answer, tool calls): the reasoning parser first, then
    the tool-call parser on the answer alone."""
    reasoning, content = None, text
    if parser:
        split = split_reasoning(text, parser)
        reasoning, content = split.reasoning, split.content or ""
    if plan is None:
        return reasoning, content, []
    content, calls = plan.parse(content)
    return reasoning, content, calls
