"""A streamed Response: the turn's pieces (`turn.TurnPiece`) as the Responses API's events.

Events, in the order the `openai` client's stream helpers check: `response.created` and
`response.in_progress`; then for each output item `response.output_item.added`, its content
part's `response.content_part.added` (reasoning and message items), its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and `response.output_item.done`;
last `response.completed` (or `response.incomplete` when cut at max_output_tokens) with the whole
Response. One item is open at a time: a new kind of piece closes the one before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kserve_paged.openai.responses_convert import function_call_item, new_id
from kserve_paged.openai.turn import TurnPiece

# (output items, status, usage, incomplete reason) -> the Response object
ResponseBuilder = Callable[[list[dict[str, Any]], str, dict[str, Any] | None, str | None],
                           dict[str, Any]]


def sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _text_part(item_type: str, text: str) -> dict[str, Any] | None:
    """The one content part of a reasoning or message item; None for a function call."""
    if item_type == "reasoning":
        return {"type": "reasoning_text", "text": text}
    if item_type == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return None


class ResponsesEvents:
    """The event text of one streamed Response, piece by piece."""

    def __init__(self, build: ResponseBuilder) -> None:
        self._build = build
        self._seq = 0
        self.output: list[dict[str, Any]] = []  # items, the open one included
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._text = ""  # the open item's text or arguments so far
        self._call_items: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(payload)

    def start(self) -> list[str]:
        response = self._build([], "in_progress", None, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _open_item(self, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.output.append(item)
        self._open, self._text = item, ""
        index = len(self.output) - 1
        shown = {**item, "status": "in_progress"}
        part = _text_part(item["type"], "")
        if part is not None:  # reasoning or message: an item with one text part
            shown["content"] = []
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=shown))
            events.append(self._event("response.content_part.added", output_index=index,
                                      item_id=item["id"], content_index=0, part=part))
        else:
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**shown, "arguments": ""}))
        return events

    def _close(self) -> list[str]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index, text = len(self.output) - 1, self._text
        events = []
        part = _text_part(item["type"], text)
        if item["type"] == "reasoning":
            item["content"] = [part]
            events += [self._event("response.reasoning_text.done", output_index=index,
                                   item_id=item["id"], content_index=0, text=text),
                       self._event("response.content_part.done", output_index=index,
                                   item_id=item["id"], content_index=0, part=part)]
        elif item["type"] == "message":
            item["content"] = [part]
            events += [self._event("response.output_text.done", output_index=index,
                                   item_id=item["id"], content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", output_index=index,
                                   item_id=item["id"], content_index=0, part=part)]
        else:
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done",
                                      output_index=index, item_id=item["id"],
                                      name=item["name"], arguments=text))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _delta(self, kind: str, delta: str) -> list[str]:
        if not delta:
            return []
        assert self._open is not None
        self._text += delta
        index = len(self.output) - 1
        fields: dict[str, Any] = {"output_index": index, "item_id": self._open["id"],
                                  "delta": delta}
        if kind != "response.function_call_arguments.delta":
            fields["content_index"] = 0
        if kind == "response.output_text.delta":
            fields["logprobs"] = []
        return [self._event(kind, **fields)]

    def piece(self, piece: TurnPiece) -> list[str]:
        events: list[str] = []
        if piece.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._open_item({"type": "reasoning", "id": new_id("rs"),
                                           "summary": [], "content": []})
            events += self._delta("response.reasoning_text.delta", piece.reasoning)
        if piece.content:
            if self._open is None or self._open["type"] != "message":
                events += self._open_item({"type": "message", "id": new_id("msg"),
                                           "role": "assistant", "content": []})
            events += self._delta("response.output_text.delta", piece.content)
        for call in piece.calls:
            item = self._call_items.get(call.index)
            if item is None:
                item = function_call_item(call.id or new_id("call"), call.name or "", "")
                self._call_items[call.index] = item
                events += self._open_item(item)
            events += self._delta("response.function_call_arguments.delta", call.arguments)
        return events

    def error(self, message: str) -> str:
        """An `error` event: the stream failed after it started."""
        return self._event("error", code="server_error", message=message, param=None)

    def finish(self, status: str, usage: dict[str, Any] | None,
               incomplete_reason: str | None) -> list[str]:
        events = self._close()
        response = self._build(self.output, status, usage, incomplete_reason)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events
