"""OpenAI's Responses API (stateless) in terms of our chat completions: the request turned into a
chat request, and a chat result turned back into a Response object.

Why through chat: a Response is one chat turn with other names (`input` items for messages,
`instructions` for the system message, `function_call` items for tool calls, `text.format` for
`response_format`). Going through the chat path gives Responses the same template, tools,
structured outputs, limits and refusals, with no second copy of any of them.

Stateless: `previous_response_id` and `store: true` need responses kept on the server, which
this one does not do; both are a 400 that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.responses_body import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    MessageItem,
    OtherFormat,
    ReasoningItem,
    ResponsesBody,
    TextConfig,
    TextPart,
)

INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)  # we send no encrypted reasoning: harmless


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(parts: list[Any], where: str) -> str:
    pieces = []
    for part in parts:
        if not isinstance(part, TextPart):
            raise APIError(400, f"{where}: content part {part.type!r} is not supported (text "
                           "only)", param="input")
        pieces.append(part.text)
    return "".join(pieces)


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """`instructions` + `input` -> chat messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text_of(item.content, where)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text_of(item.output, where)})
        elif isinstance(item, ReasoningItem):
            continue  # earlier reasoning is not replayed into the prompt (vLLM does the same)
        else:
            raise APIError(400, f"{where}: input item type {item.type!r} is not supported",
                           param="input")
    if not messages:
        raise APIError(400, "input is empty", param="input")
    return messages


def _tools(body: ResponsesBody) -> tuple[list[dict[str, Any]] | None, Any]:
    """Responses' flat function tools and tool_choice -> chat's nested ones."""
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None and not isinstance(choice, str):
        raise APIError(400, f"tool_choice type {choice.type!r} is not supported: give auto, "
                       'none, required or {"type": "function", "name": ...}',
                       param="tool_choice")
    if not body.tools:
        return None, choice
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, FunctionTool):
            raise APIError(400, f"tools[{i}]: tool type {tool.type!r} is not supported "
                           "(function tools only)", param="tools")
        tools.append({"type": "function", "function": tool.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_unset=True)})
    return tools, choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(fmt, OtherFormat):
        raise APIError(400, f"text.format type {fmt.type!r} is not supported",
                       param="text.format")
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(
        by_alias=True, exclude_unset=True, include={"name", "json_schema", "strict",
                                                    "description"})}


def chat_request(body: ResponsesBody) -> dict[str, Any]:
    """The chat completions request this Response is (ChatBody's fields). 400 for what a
    stateless server cannot do."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id needs stored responses, and this server "
                       "stores none: send the whole conversation in input",
                       param="previous_response_id")
    if body.store:
        raise APIError(400, "store: true is not supported: this server stores no responses "
                       "(send store: false or leave it out)", param="store")
    for entry in body.include or []:
        if entry not in INCLUDE_ACCEPTED:
            raise APIError(400, f"include {entry!r} is not supported", param="include")
    tools, tool_choice = _tools(body)
    request: dict[str, Any] = {"model": body.model, "messages": _messages(body),
                               "stream": body.stream}
    for ours, theirs in (("max_completion_tokens", body.max_output_tokens),
                         ("temperature", body.temperature), ("top_p", body.top_p),
                         ("tools", tools), ("tool_choice", tool_choice),
                         ("parallel_tool_calls", body.parallel_tool_calls),
                         ("response_format", _response_format(body.text)),
                         ("seed", body.seed), ("user", body.user)):
        if theirs is not None:
            request[ours] = theirs
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:  # vLLM hands it to the chat template as reasoning_effort
        request["chat_template_kwargs"] = {"reasoning_effort": effort}
    return request


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(call_id: str, name: str, arguments: str,
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def response_object(body: ResponsesBody, *, response_id: str, model: str, created: int,
                    output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                    incomplete_reason: str | None = None) -> dict[str, Any]:
    """A Response object with the request's settings echoed, as OpenAI returns it."""
    echo = body.echoed()
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "tools": echo.get("tools") or [], "tool_choice": echo.get("tool_choice") or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": echo.get("text") or {"format": {"type": "text"}}, "metadata": body.metadata or {},
        "store": False, "previous_response_id": None, "truncation": "disabled",
        "reasoning": echo.get("reasoning"), "user": body.user,
    }


def usage_object(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0,
                 cached_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """A chat finish reason -> (Response status, incomplete reason)."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def now() -> int:
    return int(time.time())
