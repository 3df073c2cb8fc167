"""What crosses between the event loop and the engine thread (engine_loop.py): the commands
queued for the engine thread, what it needs of an engine, and the report handed to step
callbacks. Kept apart from the loop, whose job is the thread: these are its vocabulary, read by
AsyncLLM (async_llm.py) and the server's metrics too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from kserve_paged_engine.frontend.request_stream import Stream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it crashed or was shut down); no request can be served."""


class EngineLike(Protocol):
    """What AsyncLLM needs of ``kserve_paged_engine.frontend.llm_engine.LLMEngine`` (tests pass a fake)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def model_info(self) -> ModelInfo: ...


@dataclasses.dataclass(slots=True)
class StepInfo:
    """Passed to the step callback after every engine-thread iteration that did something.

    ``num_tokens`` is the number of tokens the step computed (prefill chunks and decodes: the
    engine's ``last_step_tokens``), ``aborted`` the ids freed by aborts in this iteration."""

    stats: dict[str, Any]
    outputs: list[RequestOutput]
    aborted: list[str]
    num_tokens: int
    stepped: bool
    time: float


StepCallback = Callable[[StepInfo], None]


@dataclasses.dataclass(slots=True)
class Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: Stream
    future: concurrent.futures.Future[None]
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None


@dataclasses.dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class Fatal:
    """The engine can no longer step (a tensor-parallel worker died): stop the loop with it."""

    error: BaseException


@dataclasses.dataclass(slots=True)
class Call:
    """Run `fn(engine)` on the engine thread, between steps (adapter loads and unloads)."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]
