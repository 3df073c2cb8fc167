"""The bodies of `POST /v1/messages` and `/v1/messages/count_tokens`, typed after the
`anthropic` SDK's `MessageCreateParams` (its messages, content blocks, tools, tool choice and
thinking config), so a malformed body is a 400 naming the field before the converter
(convert.py) reads it.

What is typed: every field the converter reads, with the SDK's types. Block and tool kinds
the SDK has and this text server does not do (images, documents, server tools, ...) validate
as `Other*` and the converter refuses them by name. Inside blocks, fields with no effect here
(`cache_control`, `citations`, ...) are ignored; an unknown top-level field is a 400. A
tool_use block's `input` is held to the depth bound on JSON in a request field
(json_depth.py): it is rendered into the prompt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from kserve_paged.json_depth import check_depth
from kserve_paged.openai.schemas import by_type


class _Loose(BaseModel):
    """An object inside the body: the fields read here typed, others ignored."""

    model_config = ConfigDict(extra="ignore")


def _text_blocks(value: Any) -> Any:
    """A string where the SDK takes a string or blocks is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of blocks")
    return value


def _bounded(value: dict[str, Any]) -> dict[str, Any]:
    check_depth(value, "the tool_use block's input")
    return value


class TextBlock(_Loose):
    type: Literal["text"]
    text: str


class OtherBlock(_Loose):
    type: str | None = None


TextOrOther = by_type({"text": TextBlock}, OtherBlock, what="a block")
# (json_schema_input_type: what /openapi.json says is sent, a string or blocks.)
TextBlocks = Annotated[list[TextOrOther], BeforeValidator(
    _text_blocks, json_schema_input_type=str | list[TextOrOther])]


class ToolUseBlock(_Loose):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Annotated[dict[str, Any], AfterValidator(_bounded)]


class ToolResultBlock(_Loose):
    type: Literal["tool_result"]
    tool_use_id: str
    content: TextBlocks = []
    is_error: bool = False


class ThinkingBlock(_Loose):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Loose):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = by_type({"text": TextBlock, "tool_use": ToolUseBlock,
                        "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
                        "redacted_thinking": RedactedThinkingBlock}, OtherBlock,
                       what="a content block")


class Message(_Loose):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentBlock], BeforeValidator(
        _text_blocks, json_schema_input_type=str | list[ContentBlock])]


class CustomTool(_Loose):
    type: Literal["custom"] = "custom"
    name: str
    input_schema: dict[str, Any]
    description: str | None = None


class OtherTool(_Loose):
    type: str | None = None


Tool = by_type({"custom": CustomTool}, OtherTool, missing="custom", what="a tool")


class ChoiceAuto(_Loose):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ChoiceAny(_Loose):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ChoiceTool(_Loose):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ChoiceNone(_Loose):
    type: Literal["none"]


ToolChoice = by_type({"auto": ChoiceAuto, "any": ChoiceAny, "tool": ChoiceTool,
                      "none": ChoiceNone}, what="a tool choice")


class ThinkingEnabled(_Loose):
    type: Literal["enabled"]
    budget_tokens: int | None = None  # not a limit here (convert.py)


class ThinkingDisabled(_Loose):
    type: Literal["disabled"]


Thinking = by_type({"enabled": ThinkingEnabled, "disabled": ThinkingDisabled},
                   what="a thinking config")


class Metadata(_Loose):
    user_id: str | None = None


class CountTokensBody(BaseModel):
    """`POST /v1/messages/count_tokens`: a Messages request without the sampling fields."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesBody(CountTokensBody):
    """`POST /v1/messages`: the fields honoured; any other is a 400."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
