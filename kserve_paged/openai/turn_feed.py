"""A submitted single-choice turn's output as Responses and Messages read it: the whole finished
output, or its pieces as they stream. Both protocols render the same pieces in their own event
shapes, so waiting, checking and the aborted-request rule are written here once."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kserve_paged.openai.chat_turn import ChatTurn
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.render import check_output, finish_reason
from kserve_paged.openai.stream import final_outputs
from kserve_paged.openai.turn import TurnPiece, TurnStream
from kserve_paged_engine.frontend.async_llm import EngineDeadError
from kserve_paged_engine.outputs import RequestOutput


async def whole_output(turn: ChatTurn) -> RequestOutput:
    """The turn's finished output, checked (a failed request raises its APIError). A client
    that goes away cancels this (kserve_paged/middleware.py), which aborts the turn."""
    finals = await final_outputs(turn.streams)
    check_output(finals[0])
    return finals[0]


def failure_message(exc: APIError | EngineDeadError) -> str:
    """What a stream's error event says about a failure that ended it."""
    return exc.message if isinstance(exc, APIError) else str(exc)


class TurnFeed:
    """The turn's one stream as pieces (reasoning, answer, tool-call parts), in order. After the
    iteration, `final` is the finished output; an aborted request raises an APIError instead."""

    def __init__(self, turn: ChatTurn) -> None:
        self._stream = turn.streams[0]
        self.split = TurnStream(turn.plan, turn.reasoning_parser)
        self.final: RequestOutput | None = None

    async def pieces(self) -> AsyncIterator[TurnPiece]:
        async for out in self._stream:
            check_output(out)
            c = out.outputs[0]
            for piece in self.split.feed(c.delta_text, finish_reason(c) is not None):
                yield piece
            if out.finished:
                self.final = out
        if self.final is None:
            raise APIError(500, "the request was aborted")

    def close(self) -> None:
        self._stream.close()
