"""AsyncLLM: the engine behind an asyncio server.

The engine runs on a thread of its own (engine/kserve_paged_engine/frontend/engine_loop.py says why, and how the two threads
hand work over); this is its asyncio face: start it, wait until it is ready, add requests and
read their streams, abort, call the engine between steps. A refused request is a ValueError
before any streaming starts; a dead engine is an EngineDeadError for every request in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.engine_loop import (
    EngineDeadError,
    EngineLike,
    EngineLoop,
    StepCallback,
    StepInfo,
)
from kserve_paged_engine.frontend.request_stream import RequestStream, Stream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineLike", "RequestStream", "StepInfo"]



class AsyncLLM:
    """Serve an :class:`LLMEngine` to asyncio code.

    ``AsyncLLM(config)`` builds the engine on its own thread when :meth:`start` is called (model
    load and warm-up happen there, off the event loop); pass ``engine=`` to wrap one that exists.
    """

    def __init__(self, config: EngineConfig | None = None, *, engine: EngineLike | None = None,
                 engine_factory: Callable[[], EngineLike] | None = None, warmup: bool = True,
                 step_callback: StepCallback | None = None) -> None:
        if engine is not None and engine_factory is not None:
            raise ValueError("pass engine or engine_factory, not both")
        self.config = config if config is not None else EngineConfig()
        self._loop = EngineLoop(self.config, engine, engine_factory, warmup,
                                [step_callback] if step_callback else [])
        self._info: ModelInfo | None = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        return cls(config, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (which loads the model first when none was given)."""
        self._loop.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still in flight end with EngineDeadError."""
        self._loop.shutdown(timeout)

    async def __aenter__(self) -> AsyncLLM:
        self.start()
        await self.wait_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)

    @property
    def is_ready(self) -> bool:
        """Loaded, warmed up and alive: what a readiness probe should report."""
        loop = self._loop
        return loop.ready.is_set() and loop.dead is None and not loop.stopping

    def is_healthy(self) -> bool:
        """False once the engine thread died (or was shut down); it never recovers."""
        return self._loop.dead is None and not self._loop.stopping

    @property
    def num_unfinished(self) -> int:
        """Requests accepted or queued and not yet ended: what a graceful shutdown waits for."""
        return self._loop.num_unfinished

    @property
    def error(self) -> BaseException | None:
        """Why the engine is dead, if it is."""
        return self._loop.dead

    @property
    def engine(self) -> EngineLike:
        """The wrapped engine (tests and benchmarks; servers read :meth:`model_info`)."""
        if self._loop.engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._loop.engine

    def model_info(self) -> ModelInfo:
        """The loaded engine's static facts, asked of it once (RuntimeError before it loads).
        What a server needs of the engine comes from here, not from the engine's attributes."""
        if self._info is None:
            self._info = self.engine.model_info()
        return self._info

    async def wait_ready(self) -> None:
        """Return once the engine can serve; raise EngineDeadError if loading failed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._loop.wait_ready(loop, fut)
        await fut
        dead = self._loop.dead
        if dead is not None:
            raise EngineDeadError(f"engine failed: {dead!r}") from dead

    def add_step_callback(self, callback: StepCallback) -> None:
        """Called on the engine thread after each iteration (keep it cheap, never raise)."""
        self._loop.callbacks.append(callback)

    @property
    def num_waiting(self) -> int:
        """Requests waiting: queued for the engine thread, or in its waiting queue as of the
        last step (what --max_waiting_requests bounds)."""
        return self._loop.num_waiting

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the last iteration (a snapshot; safe from any thread)."""
        return dict(self._loop.stats)

    # -- requests ---------------------------------------------------------------------------

    async def add(self, prompt: str | list[int], params: SamplingParams,
                  request_id: str | None = None, *, priority: int = 0,
                  cache_salt: str | None = None,
                  lora_request: LoRARequest | None = None, deadline: float | None = None,
                  on_deadline: Callable[[], None] | None = None,
                  pooling_params: PoolingParams | None = None) -> RequestStream:
        """Queue a request and return its output stream once the engine accepted it. With a
        ``deadline`` (``time.monotonic()``), the stream aborts the request when it passes and
        ends with an error output (RequestStream).

        Raises ValueError (the engine's message) for a request it refuses, so a server can
        answer 400 before it commits to a streaming response."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        stream = Stream(request_id, asyncio.get_running_loop())
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop.add(request_id, prompt, params, priority, cache_salt, lora_request, stream,
                       future, pooling_params)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._loop.abort_nowait([request_id])  # the add may still land: undo it
            raise
        return RequestStream(self._loop.abort_nowait, stream, deadline, on_deadline)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs, one per engine step that produced a token, the last
        one with ``finished=True``. Raises ValueError for a request the engine refuses. If the
        caller stops iterating (client disconnect, cancellation), the request is aborted."""
        stream = await self.add(prompt, params, request_id, priority=priority,
                                cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call_engine(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread between steps; its exception is raised here."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._loop.call(fn, future)
        return await asyncio.wrap_future(future)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (ValueError if it is bad or LoRA is off)."""
        return await self.call_engine(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call_engine(lambda engine: engine.remove_lora(lora_int_id))

    async def abort(self, request_id: str | list[str]) -> None:
        """Free everything the request(s) hold; their generate() streams end. Unknown ids are
        ignored."""
        self._loop.abort_nowait([request_id] if isinstance(request_id, str)
                                else list(request_id))
