"""Tool calling for chat: the request's tools checked, their constraint, and the model's
tool-call text parsed back into OpenAI's ``tool_calls`` (design: docs/kserve.md, "Tools").

- ``tool_choice: "none"``: plain chat; the tools do not reach the template.
- ``"auto"`` (OpenAI's default when tools are given): the tools go through the chat template and
  the model decides; its text is read by the ``--tool_call_parser`` (Hermes' ``<tool_call>``
  tags, Llama 3's bare JSON, or gpt-oss' Harmony calls: openai/harmony.py).
- ``"required"`` or a named function: the output is held to the tools' JSON schemas (a list of
  ``{"name", "parameters"}`` objects, or the named function's arguments), so it always parses,
  whatever the model or its template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion_chunk import ChoiceDelta

from kserve_paged.json_depth import JSONTooDeep, check_depth, loads, raw_decode
from kserve_paged.openai.errors import APIError
from kserve_paged_engine import limits

# gpt-oss' Harmony calls (`commentary to=functions.NAME`), read by harmony.py (vLLM's name).
HARMONY_TOOL_PARSER = "openai"
TOOL_CALL_PARSERS = ("hermes", "llama3_json", HARMONY_TOOL_PARSER, "none")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _bad(message: str, param: str = "tools") -> APIError:
    return APIError(400, message, param=param)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its output."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or "function" (named); "none" makes no plan
    parser: str
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return self.tools

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output constraint that makes the output a valid call, or None."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.choice == "function":
            return {"json": by_name[self.function].get("parameters") or {"type": "object"}}
        if self.choice == "required":
            items = [{"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"const": name},
                                     "parameters": fn.get("parameters") or {"type": "object"}}}
                     for name, fn in by_name.items()]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json": schema}
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, tool calls); text that holds no call is all content."""
        if self.choice == "function":
            return None, [ToolCall(self.function or "", text.strip())]
        if self.choice == "required":
            try:
                calls = loads(text, "the tool calls")
            except ValueError:
                return text, []  # cut short (length): not a call
            return None, [ToolCall(c["name"], json.dumps(c.get("parameters", {}),
                                                        ensure_ascii=False)) for c in calls]
        if self.parser == "hermes":
            return parse_hermes(text)
        if self.parser == "llama3_json":
            return parse_llama3_json(text)
        return text, []


def checked_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's tools as the chat template receives them, each checked (its count,
    names, parameters' shape); a malformed one is a 400. Chat and /tokenize both use it."""
    if not isinstance(tools, list):
        raise _bad("tools must be a list")
    if len(tools) > limits.MAX_TOOLS:
        raise _bad(f"{len(tools)} tools, more than {limits.MAX_TOOLS} per request")
    names: set[str] = set()
    checked = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or (
                not isinstance(fn, dict)):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
        if name in names:
            raise _bad(f"tools[{i}]: the function name {name!r} is given twice")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            limits.check_schema_shape(params, f"tools[{i}].function.parameters")
            check_depth(fn, f"tools[{i}].function")  # the template renders all of it
        except ValueError as exc:
            raise _bad(str(exc)) from None
        names.add(name)
        checked.append({"type": "function", "function": fn})
    return checked


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
              parser: str) -> ToolPlan | None:
    """The request's plan, or None for plain chat; a malformed tool or choice is a 400."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice not in ("none", None):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    checked = checked_tools(tools)
    names = {tool["function"]["name"] for tool in checked}
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("tool_choice must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools",
                       "tool_choice")
        return ToolPlan(checked, "function", parser, function=name)
    if tool_choice not in ("auto", "required"):
        raise _bad(f"tool_choice {tool_choice!r} is not one of none, auto, required or a "
                   "named function", "tool_choice")
    if tool_choice == "auto" and parser == "none":
        raise _bad("tool_choice \"auto\" needs a tool-call parser: start the server with "
                   "--tool_call_parser hermes, llama3_json or openai", "tool_choice")
    return ToolPlan(checked, tool_choice, parser, parallel=parallel is not False)


def _call_from_json(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number of them; the text before the first tag is the content."""
    if _HERMES_OPEN not in text:
        return text, []
    calls = []
    for body in re.findall(re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE)
                           + r"|$)", text, flags=re.S):
        try:
            call = _call_from_json(loads(body.strip(), "a tool call"), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []  # an unreadable call: hand the text back as it is
        calls.append(call)
    content = text[:text.index(_HERMES_OPEN)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x JSON style: the whole output is ``{"name": ..., "parameters": {...}}``
    (optionally after ``<|python_tag|>``), several separated by ``;``."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = raw_decode(decoder, body, pos, "a tool call")
        except ValueError:
            return text, []
        call = _call_from_json(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def may_start_call(plan: ToolPlan, text: str) -> int:
    """How much of a streamed choice's text is surely content: everything before where a tool
    call starts, or could still start (a partial ``<tool_call>`` tag at the end is held back).
    Streaming sends that much as content and keeps the rest until the end."""
    if plan.choice != "auto":
        return 0
    if plan.parser == "hermes":
        at = text.find(_HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if _HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    if plan.parser == "llama3_json":
        stripped = text.lstrip()
        if not stripped:
            return 0
        if stripped.startswith("{") or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]):
            return 0
        return len(text)
    return len(text)


def _template_arguments(arguments: Any, what: str) -> Any:
    """A call's arguments for the template: JSON text parsed (text that is not JSON stays
    text), an object as it is; either nested deeper than limits.MAX_JSON_DEPTH is a 400."""
    try:
        if not isinstance(arguments, str):
            check_depth(arguments, what)
            return arguments
        try:
            return loads(arguments, what)
        except JSONTooDeep:
            raise
        except ValueError:  # not JSON: left as text
            return arguments
    except JSONTooDeep as exc:
        raise APIError(400, str(exc), param="messages") from None


def template_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as objects
    (the templates render them with ``tojson``), not OpenAI's JSON text. Arguments nested
    deeper than limits.MAX_JSON_DEPTH are a 400 (json_depth.py)."""
    out = []
    for i, message in enumerate(conversation):
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and "arguments" in fn:
                    what = f"messages[{i}].tool_calls[{j}].function.arguments"
                    fn = {**fn, "arguments": _template_arguments(fn["arguments"], what)}
                    call = {**call, "function": fn}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


def with_calls(reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish_reason for a choice that made tool calls (a cut-short one stays
    "length")."""
    return "tool_calls" if calls and reason == "stop" else reason


class StreamedCalls:
    """One streamed choice's text turned into content and ``delta.tool_calls`` chunks.

    A named function streams its arguments as they come; otherwise content streams until a
    tool call may have started (see tools.may_start_call) and the calls are sent whole at the
    end, each as one chunk, which is how they reassemble to the non-streamed answer."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0  # characters of the text already sent (as content or arguments)
        self.calls: list[ToolCall] = []
        self._named: ToolCall | None = None

    def feed(self, text: str, finished: bool) -> list[ChoiceDelta]:
        plan = self.plan
        if plan.choice == "function":
            deltas = []
            if self._named is None:
                self._named = ToolCall(plan.function or "", "")
                self.calls = [self._named]
                deltas.append(ChoiceDelta(tool_calls=[
                    {"index": 0, "id": self._named.id, "type": "function",
                     "function": {"name": self._named.name, "arguments": ""}}]))
            piece = text[self.sent:]
            self.sent = len(text)
            self._named.arguments += piece
            if piece:
                deltas.append(ChoiceDelta(tool_calls=[{"index": 0,
                                                       "function": {"arguments": piece}}]))
            return deltas
        deltas = []
        if finished:
            _, self.calls = plan.parse(text)
            # With calls, the content is what came before the first; without, all of it.
            upto = may_start_call(plan, text) if self.calls else len(text)
        else:
            upto = may_start_call(plan, text)
        if upto > self.sent:
            deltas.append(ChoiceDelta(content=text[self.sent:upto]))
            self.sent = upto
        if finished and self.calls:
            deltas.append(ChoiceDelta(tool_calls=[call.to_openai(i)
                                                  for i, call in enumerate(self.calls)]))
        return deltas
