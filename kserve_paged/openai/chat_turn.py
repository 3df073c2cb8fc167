"""One chat turn from a ChatBody to engine streams, shared by chat completions, Responses and
Messages: the chat template (tools, `chat_template_kwargs` over the server's defaults), the
tokenizer, the tool plan, and, for a reasoning model, where a constraint may start.

Structured outputs and reasoning: a JSON schema (or a tool call's constraint) holds the answer,
not the thinking. The engine's grammar can wait (`StructuredOutputs.start_after_token_id`,
engine/kserve_paged_engine/sample/structured_output.py): it is inactive until the model samples the end-of-thinking
token, and holds from the next token on. When the prompt already closed the thinking (Qwen3 with
`enable_thinking` false), the grammar holds from the first token. Harmony (gpt-oss) waits for
the token sequence that opens the final channel, so the analysis channel runs free.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import Request

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.harmony import FINAL_HEADER, HARMONY_PARSER, parse_harmony
from kserve_paged.openai.harmony_template import HARMONY_CHAT_TEMPLATE
from kserve_paged.openai.reasoning import END, START, split_reasoning
from kserve_paged.openai.schemas import ChatBody
from kserve_paged.openai.submission import submit_prompts
from kserve_paged.openai.tools import (
    HARMONY_TOOL_PARSER,
    ToolCall,
    ToolPlan,
    template_messages,
    tool_plan,
)
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
    effort = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}
    return {**model.default_chat_template_kwargs, **effort, **given}


async def render_prompt(model: ServedModel, body: ChatBody, plan: ToolPlan | None
                        ) -> list[int]:
    """The messages through the chat template (tools and template kwargs passed to it) and
    the tokenizer, both on a worker thread; their length is checked before either sees them.
    A Harmony model without a template of its own gets ours (harmony_template.py)."""
    info = model.info
    own_template = fallback_template(model, "use /completions")
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
            tools=plan.template_tools if plan else None, **own_template, **extra)
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


@lru_cache(maxsize=16)
def is_gpt_oss(model_path: str) -> bool:
    """Whether the checkpoint at `model_path` is a gpt-oss model (its config's model_type):
    its chat then speaks Harmony whatever the flags say, as in vLLM."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "gpt_oss"


def turn_reasoning_parser(reasoning_parser: str | None, tool_call_parser: str,
                          model_path: str) -> str | None:
    """The reasoning parser a chat turn uses: the one the server was given; else Harmony's
    when the tool-call parser is `openai` or the model is gpt-oss (its output is Harmony
    text, unreadable as plain chat)."""
    if reasoning_parser:
        return reasoning_parser
    if tool_call_parser == HARMONY_TOOL_PARSER or is_gpt_oss(model_path):
        return HARMONY_PARSER
    return None


def fallback_template(model: ServedModel, instead: str) -> dict[str, Any]:
    """The apply_chat_template argument giving a Harmony model without a template of its own
    ours (harmony_template.py); {} for a model with one; a 400 (saying what to do `instead`)
    for any other model without one."""
    if model.info.has_chat_template:
        return {}
    if _reasoning_parser(model) == HARMONY_PARSER:
        return {"chat_template": HARMONY_CHAT_TEMPLATE}
    raise APIError(400, f"this model has no chat template; {instead}", param="messages")


def _reasoning_parser(model: ServedModel) -> str | None:
    return turn_reasoning_parser(model.reasoning_parser, model.tool_call_parser,
                                 model.info.model_path)


def reasoning_gate(model: ServedModel, prompt_ids: list[int], parser: str | None = None
                   ) -> int | tuple[int, ...] | None:
    """The token a constraint waits for (the end of thinking), or None when the thinking is
    already over in the prompt (its last end tag comes after its last start tag). Harmony:
    the tokens that open the final channel (a turn's prompt never opens it)."""
    tokenizer = model.info.tokenizer
    if parser == HARMONY_PARSER:
        return tuple(int(t) for t in tokenizer.encode(FINAL_HEADER, add_special_tokens=False))
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
    parser = _reasoning_parser(model)
    if parser == HARMONY_PARSER:  # the channels' tags are special tokens: they must be kept
        options = options.with_values(skip_special_tokens=False)
    prompt_ids = await render_prompt(model, body, plan)
    if parser and options.structured is not None:
        gate = reasoning_gate(model, prompt_ids, parser)
        if gate is not None:
            options.structured.start_after_token_id = gate
    salt = body.cache_salt or request.headers.get("x-cache-salt")
    streams = await submit_prompts(model, [prompt_ids], options, kind=kind,
                                   priority=body.priority, cache_salt=salt, deadline=deadline)
    return ChatTurn(streams, plan, parser, len(prompt_ids))


def split_turn(text: str, plan: ToolPlan | None, parser: str | None
               ) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole output's (reasoning, answer, tool calls): the reasoning parser first, then
    the tool-call parser on the answer alone. Harmony splits all three at once; a call it
    finds counts only with tool_choice "auto" (a required or named call is the constrained
    JSON of the final channel)."""
    reasoning, content = None, text
    if parser == HARMONY_PARSER:
        reasoning, content, calls = parse_harmony(text)
        if plan is None:
            return reasoning, content, []
        if plan.choice == "auto":
            return reasoning, content, calls
        content, calls = plan.parse(content or "")
        return reasoning, content, calls
    if parser:
        split = split_reasoning(text, parser)
        reasoning, content = split.reasoning, split.content or ""
    if plan is None:
        return reasoning, content, []
    content, calls = plan.parse(content)
    return reasoning, content, calls
