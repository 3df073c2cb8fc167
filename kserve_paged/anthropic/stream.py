"""A streamed Message: the turn's pieces (`openai/turn.py`) as Anthropic's events.

`message_start`; then per content block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, or `input_json_delta` for a tool_use block's arguments) and
`content_block_stop`; last `message_delta` (stop reason, output tokens) and `message_stop`.
One block is open at a time; a piece of another kind closes it. The finished blocks are kept,
so the non-streamed Message and the streamed one are built by the same code.
"""

from __future__ import annotations

import json
from typing import Any

from kserve_paged.anthropic.convert import tool_input
from kserve_paged.openai.turn import TurnPiece


def sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessageEvents:
    """Collects a turn's blocks and, for streaming, the event text of each step."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._args = ""  # the open tool_use block's JSON text
        self._calls: dict[int, dict[str, Any]] = {}

    def message(self, stop_reason: str | None, stop_sequence: str | None,
                output_tokens: int) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": self.blocks, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def start(self) -> list[str]:
        message = {**self.message(None, None, 0), "content": []}
        return [sse_event({"type": "message_start", "message": message})]

    def _open_block(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        events.append(sse_event({"type": "content_block_start", "index": len(self.blocks) - 1,
                                 "content_block": shown}))
        return events

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        if self._open["type"] == "tool_use":
            self._open["input"] = tool_input(self._args)
            self._args = ""
        self._open = None
        return [sse_event({"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event({"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": delta})

    def piece(self, piece: TurnPiece) -> list[str]:
        events: list[str] = []
        if piece.reasoning:
            if self._open is None or self._open["type"] != "thinking":
                events += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
            assert self._open is not None
            self._open["thinking"] += piece.reasoning
            events.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            if self._open is None or self._open["type"] != "text":
                events += self._open_block({"type": "text", "text": ""})
            assert self._open is not None
            self._open["text"] += piece.content
            events.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.calls:
            if call.index not in self._calls:
                block = {"type": "tool_use", "id": call.id or f"toolu_{call.index}",
                         "name": call.name or "", "input": {}}
                self._calls[call.index] = block
                events += self._open_block(block)
            if call.arguments:
                self._args += call.arguments
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": call.arguments}))
        return events

    def finish(self, stop_reason: str, stop_sequence: str | None,
               output_tokens: int) -> list[str]:
        events = self._close()
        events.append(sse_event({"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason,
                                           "stop_sequence": stop_sequence},
                                 "usage": {"output_tokens": output_tokens}}))
        events.append(sse_event({"type": "message_stop"}))
        return events
