"""The body of `POST /v1/responses`, typed after the `openai` SDK's `ResponseCreateParams`
(its input items, content parts, function tools, tool choice, `text.format` and `reasoning`),
so a malformed body is a 400 naming the field before the converter (responses_convert.py)
reads it.

What is typed: every field the converter reads, with the SDK's types. Kinds the SDK has and
this stateless text server does not do (image parts, hosted tools, item references, ...)
validate as `Other*` and the converter refuses them by name. Inside items, fields with no
effect here (`id`, `status`, `annotations`, ...) are ignored, as the SDK sends them back from
earlier responses; an unknown top-level field is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kserve_paged.openai.schemas import by_type

TEXT_PARTS = ("input_text", "output_text", "text")


class _Loose(BaseModel):
    """An object inside the body: the fields read here typed, others ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(_Loose):
    type: str | None = None


def _text_parts(value: Any) -> Any:
    """A string where the SDK takes a string or parts is one text part."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    return value


Part = by_type(dict.fromkeys(TEXT_PARTS, TextPart), OtherPart, what="a content part")
# (json_schema_input_type: what /openapi.json says is sent, a string or parts.)
Parts = Annotated[list[Part], BeforeValidator(_text_parts,
                                              json_schema_input_type=str | list[Part])]


class MessageItem(_Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Parts


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, parsed under the depth bound when rendered (json_depth.py)


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: str
    output: Parts


class ReasoningItem(_Loose):
    type: Literal["reasoning"]  # earlier reasoning is not replayed into the prompt


class OtherItem(_Loose):
    type: str | None = None


def _user_text(value: Any) -> Any:
    """`input` as a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of input items")
    return value


InputItem = by_type({"message": MessageItem, "function_call": FunctionCallItem,
                     "function_call_output": FunctionCallOutputItem,
                     "reasoning": ReasoningItem}, OtherItem, missing="message",
                    what="an input item")


class FunctionTool(_Loose):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class OtherTool(_Loose):
    type: str | None = None


class FunctionChoice(_Loose):
    type: Literal["function"]
    name: str


class OtherChoice(_Loose):
    type: str | None = None


class FormatText(_Loose):
    type: Literal["text"]


class FormatJSONObject(_Loose):
    type: Literal["json_object"]


class FormatJSONSchema(_Loose):
    type: Literal["json_schema"]
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class OtherFormat(_Loose):
    type: str | None = None


class TextConfig(_Loose):
    format: by_type({"text": FormatText, "json_object": FormatJSONObject,
                     "json_schema": FormatJSONSchema}, OtherFormat,
                    what="a format") | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Loose):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesBody(BaseModel):
    """The fields of `POST /v1/responses` this server honours; any other field is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Annotated[list[InputItem], BeforeValidator(
        _user_text, json_schema_input_type=str | list[InputItem])]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[by_type({"function": FunctionTool}, OtherTool, what="a tool")] | None = None
    tool_choice: by_type({"function": FunctionChoice}, OtherChoice, what="a tool choice",
                         mode=Literal["none", "auto", "required"]) | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = None

    def echoed(self) -> dict[str, Any]:
        """The settings as a Response object repeats them: what the client sent, as JSON."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True,
                               include={"tools", "tool_choice", "text", "reasoning"})
