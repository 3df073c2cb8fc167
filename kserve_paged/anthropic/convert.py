"""Anthropic Messages requests as chat requests, and a finished chat turn as a Message.

Why through chat: a Message is one chat turn; the same template, tools, limits and refusals
apply. Content blocks map one to one: `text` to text, an assistant's `tool_use` to a tool
call, a user's `tool_result` to a `tool` message before the user's own text; `thinking` blocks
of earlier turns are not replayed. `thinking: {"type": "enabled" | "disabled"}` becomes the
chat template's `enable_thinking` (the switch Qwen3's template and others read): our mapping,
Anthropic's budget_tokens is not a limit here.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kserve_paged.openai.errors import APIError


class MessagesBody(BaseModel):
    """`POST /v1/messages`: the fields honoured; any other is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensBody(BaseModel):
    """`POST /v1/messages/count_tokens`: a Messages request without the sampling fields."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}: content must be a string or a list of blocks",
                       param="messages")
    return content


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    parts = []
    for block in blocks:
        if block.get("type") != "text":
            raise APIError(400, f"{where}: a {block.get('type')!r} block here is not supported",
                           param="messages")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _turn(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role = message.get("role")
    blocks = _blocks(message.get("content", ""), where)
    if role == "user":
        out, text = [], []
        for block in blocks:
            kind = block.get("type")
            if kind == "tool_result":
                result = block.get("content", "")
                body = result if isinstance(result, str) else _text(result, where)
                if block.get("is_error"):
                    body = f"Error: {body}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": body})
            elif kind == "text":
                text.append(str(block.get("text", "")))
            else:
                raise APIError(400, f"{where}: block type {kind!r} is not supported (text, "
                               "tool_result)", param="messages")
        if text:
            out.append({"role": "user", "content": "".join(text)})
        return out
    if role == "assistant":
        text, calls = [], []
        for block in blocks:
            kind = block.get("type")
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input", {}),
                                                                   ensure_ascii=False)}})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise APIError(400, f"{where}: block type {kind!r} is not supported (text, "
                               "tool_use, thinking)", param="messages")
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    raise APIError(400, f"{where}: role must be user or assistant, got {role!r}",
                   param="messages")


def _tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None
           ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools:
        converted = []
        for i, tool in enumerate(tools):
            if tool.get("type", "custom") != "custom" or "name" not in tool:
                raise APIError(400, f"tools[{i}]: only custom tools with a name and an "
                               f"input_schema are supported (got type {tool.get('type')!r})",
                               param="tools")
            fn = {"name": tool["name"],
                  "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        out["tools"] = converted
    if choice is not None:
        kind = choice.get("type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "none":
            out["tool_choice"] = "none"
        elif kind == "tool" and choice.get("name"):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise APIError(400, "tool_choice must be auto, any, none or {\"type\": \"tool\", "
                           "\"name\": ...}", param="tool_choice")
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise APIError(400, "thinking.type must be enabled or disabled", param="thinking")
    return {"chat_template_kwargs": {"enable_thinking": kind == "enabled"}}


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
                               **_tools(body.tools, body.tool_choice), **_thinking(body.thinking)}
    for ours, theirs in (("stop", body.stop_sequences), ("temperature", body.temperature),
                         ("top_p", body.top_p), ("top_k", body.top_k)):
        if theirs is not None:
            request[ours] = theirs
    return request


def count_request(body: CountTokensBody) -> dict[str, Any]:
    """What the template renders for count_tokens (ChatBody's fields, no sampling)."""
    return {"model": body.model, "messages": conversation(body),
            **_tools(body.tools, body.tool_choice), **_thinking(body.thinking)}


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
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
