"""Anthropic Messages requests as chat requests, and a finished chat turn as a Message.

Why through chat: a Message is one chat turn; the same template, tools, limits and refusals
apply. Content blocks map one to one: `text` to text, an assistant's `tool_use` to a tool
call, a user's `tool_result` to a `tool` message before the user's own text; `thinking` blocks
of earlier turns are not replayed. `thinking: {"type": "enabled" | "disabled"}` becomes the
chat template's `enable_thinking` (the switch Qwen3's template and others read): our mapping,
Anthropic's budget_tokens is not a limit here. The body's types, after the SDK's: body.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kserve_paged.anthropic.body import (
    ChoiceAny,
    ChoiceAuto,
    ChoiceNone,
    ChoiceTool,
    CountTokensBody,
    CustomTool,
    Message,
    MessagesBody,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from kserve_paged.json_depth import loads
from kserve_paged.openai.errors import APIError


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _text(blocks: list[Any], where: str) -> str:
    parts = []
    for block in blocks:
        if not isinstance(block, TextBlock):
            raise APIError(400, f"{where}: a {block.type!r} block here is not supported",
                           param="messages")
        parts.append(block.text)
    return "".join(parts)


def _system(system: list[Any] | None, where: str = "system") -> list[dict[str, Any]]:
    text = _text(system, where) if system is not None else ""
    return [{"role": "system", "content": text}] if text else []


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out, text = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            body = _text(block.content, f"{where}.tool_result.content")
            if block.is_error:
                body = f"Error: {body}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": body})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise APIError(400, f"{where}: block type {block.type!r} is not supported (text, "
                           "tool_result)", param="messages")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    text, calls = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input,
                                                               ensure_ascii=False)}})
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise APIError(400, f"{where}: block type {block.type!r} is not supported (text, "
                           "tool_use, thinking)", param="messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _turn(message: Message, where: str) -> list[dict[str, Any]]:
    if message.role == "user":
        return _user(message.content, where)
    if message.role == "assistant":
        return [_assistant(message.content, where)]
    return _system(message.content, where)  # the SDK's system-role message


def _tools(body: CountTokensBody) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if body.tools:
        converted = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool, CustomTool):
                raise APIError(400, f"tools[{i}]: only custom tools with a name and an "
                               f"input_schema are supported (got type {tool.type!r})",
                               param="tools")
            fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                fn["description"] = tool.description
            converted.append({"type": "function", "function": fn})
        out["tools"] = converted
    choice = body.tool_choice
    if isinstance(choice, ChoiceAuto):
        out["tool_choice"] = "auto"
    elif isinstance(choice, ChoiceAny):
        out["tool_choice"] = "required"
    elif isinstance(choice, ChoiceNone):
        out["tool_choice"] = "none"
    elif isinstance(choice, ChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if getattr(choice, "disable_parallel_tool_use", False):
        out["parallel_tool_calls"] = False
    return out


def _thinking(body: CountTokensBody) -> dict[str, Any]:
    if body.thinking is None:
        return {}
    enabled = isinstance(body.thinking, ThinkingEnabled)
    return {"chat_template_kwargs": {"enable_thinking": enabled}}


def conversation(body: MessagesBody | CountTokensBody) -> list[dict[str, Any]]:
    """The request's system prompt and turns as chat messages."""
    messages = _system(body.system)
    for i, message in enumerate(body.messages):
        messages.extend(_turn(message, f"messages[{i}]"))
    return messages


def chat_request(body: MessagesBody) -> dict[str, Any]:
    """The chat completions request (ChatBody's fields) this Messages request is."""
    request: dict[str, Any] = {"model": body.model, "messages": conversation(body),
                               "max_completion_tokens": body.max_tokens, "stream": body.stream,
                               **_tools(body), **_thinking(body)}
    for ours, theirs in (("stop", body.stop_sequences), ("temperature", body.temperature),
                         ("top_p", body.top_p), ("top_k", body.top_k)):
        if theirs is not None:
            request[ours] = theirs
    return request


def count_request(body: CountTokensBody) -> dict[str, Any]:
    """What the template renders for count_tokens (ChatBody's fields, no sampling)."""
    return {"model": body.model, "messages": conversation(body),
            **_tools(body), **_thinking(body)}


def stop_reason(finish_reason: str | None, stop: int | str | None, has_calls: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a finished turn."""
    if has_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def tool_input(arguments: str) -> Any:
    """A call's JSON arguments as the tool_use block's input (text that is not JSON stays a
    string under `_raw`: the block must carry an object)."""
    try:
        value = loads(arguments, "a tool call's arguments") if arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
