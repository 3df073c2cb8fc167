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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kserve_paged.openai.errors import APIError

_TEXT_PARTS = ("input_text", "output_text", "text")
INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)  # we send no encrypted reasoning: harmless


class ResponsesBody(BaseModel):
    """The fields of `POST /v1/responses` this server honours; any other field is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts",
                       param="input")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"{where}: content part {kind!r} is not supported (text only)",
                           param="input")
        pieces.append(str(part.get("text", "")))
    return "".join(pieces)


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """`instructions` + `input` -> chat messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: role {role!r} is not one of user, assistant, "
                               "system, developer", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or new_id("call"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed into the prompt (vLLM does the same)
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported",
                           param="input")
    if not messages:
        raise APIError(400, "input is empty", param="input")
    return messages


def _tools(body: ResponsesBody) -> tuple[list[dict[str, Any]] | None, Any]:
    """Responses' flat function tools and tool_choice -> chat's nested ones."""
    if not body.tools:
        return None, body.tool_choice
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported "
                           "(function tools only)", param="tools")
        tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(400, "tool_choice must be auto, none, required or "
                           '{"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type {fmt.get('type')!r} is not supported",
                   param="text.format")


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
    effort = (body.reasoning or {}).get("effort")
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
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
        "store": False, "previous_response_id": None, "truncation": "disabled",
        "reasoning": body.reasoning, "user": body.user,
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
