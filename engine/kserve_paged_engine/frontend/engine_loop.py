"""The engine loop: the thread that owns an `LLMEngine` and the only cross-thread traffic.

Why a dedicated thread: a model forward takes milliseconds to seconds; on the event loop it would
stall every HTTP connection. torch releases the GIL inside its kernels, so a thread running the
step loop leaves the loop responsive without the cost of a second process.

Hand-off rules (the only cross-thread traffic):
- event loop -> engine thread: commands (add / abort / call) appended to a deque under a
  Condition; the engine thread drains them between steps, so ``LLMEngine`` is only ever touched
  by its thread.
- engine thread -> event loop: each request has a stream fed with
  ``loop.call_soon_threadsafe`` (engine/kserve_paged_engine/frontend/request_stream.py). An add's ``concurrent.futures.Future``
  is resolved here, so validation errors from ``add_request`` reach the caller as ``ValueError``.
- An idle engine thread sleeps on the Condition (no busy spin); a command wakes it.

The commands, the engine's face (`EngineLike`) and the step report (`StepInfo`) are
engine_commands.py. If the step loop raises, every in-flight request fails with :class:`EngineDeadError` and the
loop is dead for good: a serving process should be restarted, not limp on with a half-updated
scheduler. `AsyncLLM` (engine/kserve_paged_engine/frontend/async_llm.py) is the asyncio face of this loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.engine_commands import (
    Abort,
    Add,
    Call,
    EngineDeadError,
    EngineLike,
    Fatal,
    StepCallback,
    StepInfo,
)
from kserve_paged_engine.frontend.request_stream import END, Stream
from kserve_paged_engine.limits import request_id_in_use
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

logger = logging.getLogger("kserve_paged_engine")


class EngineLoop:
    """The engine thread: between steps it applies the queued commands, then steps while any
    request is unfinished, and hands each output to its request's stream."""

    def __init__(self, config: EngineConfig, engine: EngineLike | None,
                 factory: Callable[[], EngineLike] | None, warmup: bool,
                 callbacks: list[StepCallback]) -> None:
        self.config = config
        self.engine: EngineLike | None = engine
        self._factory = factory
        self._warmup = warmup
        self.callbacks = callbacks
        self._cond = threading.Condition()
        self._commands: collections.deque[Add | Abort | Call | Fatal] = collections.deque()
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.stopping = False
        self.dead: BaseException | None = None
        self.ready = threading.Event()
        self._ready_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.stats: dict[str, Any] = {}
        self._applied_adds = 0  # adds applied since the last stats (num_waiting)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kserve-paged-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        """Requests accepted or queued and not yet ended. (Sizes of containers the engine thread
        mutates; reading them from another thread is safe under the GIL, and a momentarily
        stale count only delays a drain by a poll.)"""
        return len(self._streams) + len(self._commands)

    @property
    def num_waiting(self) -> int:
        """Adds not applied yet plus the engine's waiting requests at the last step."""
        with self._cond:  # the deque is appended to and drained from other threads
            pending = sum(1 for c in self._commands if isinstance(c, Add))
            return (pending + self._applied_adds
                    + int(self.stats.get("num_waiting", 0) or 0))

    def wait_ready(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        """Resolve `fut` (on `loop`) once the engine can serve or has died."""
        with self._cond:
            if self.dead is None and not self.ready.is_set():
                self._ready_waiters.append((loop, fut))
                return
        fut.set_result(None)

    def abort_nowait(self, request_ids: list[str]) -> None:
        with self._cond:
            if self.dead is not None or self.stopping:
                return
            self._commands.append(Abort(request_ids))
            self._cond.notify()

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
            priority: int, cache_salt: str | None, lora_request: LoRARequest | None,
            stream: Stream, future: concurrent.futures.Future[None],
            pooling_params: PoolingParams | None = None) -> None:
        """Queue an add; `future` resolves once the engine accepted (or refused) it."""
        self._submit(Add(request_id, prompt, params, priority, cache_salt, stream, future,
                          lora_request, pooling_params))

    def call(self, fn: Callable[[Any], Any], future: concurrent.futures.Future[Any]) -> None:
        """Queue `fn(engine)` for the engine thread, between steps; `future` gets its result."""
        self._submit(Call(fn, future))

    def _submit(self, command: Add | Call) -> None:
        with self._cond:
            if self.dead is not None or self.stopping:
                reason = self.dead
                command.future.set_exception(EngineDeadError(
                    "the engine is shut down" if reason is None else f"the engine died: {reason!r}"))
                return
            self._commands.append(command)
            self._cond.notify()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.engine is None:
                started = time.monotonic()
                logger.info("loading the engine (model %s)", self.config.model or "<default>")
                self.engine = (self._factory() if self._factory is not None
                                else _build_engine(self.config))
                logger.info("engine loaded in %.1fs", time.monotonic() - started)
            if self._warmup and hasattr(self.engine, "warmup"):
                started = time.monotonic()
                self.engine.warmup()  # type: ignore[attr-defined]
                logger.info("engine warm-up done in %.1fs", time.monotonic() - started)
            on_fatal = getattr(self.engine, "on_fatal", None)
            if on_fatal is not None:
                on_fatal(self._fatal)
            self.stats = dict(self.engine.stats())
            self._set_ready()
            self._loop(self.engine)
        except BaseException as exc:  # noqa: BLE001 - anything kills the engine, report it all
            logger.exception("the engine thread failed")
            self._die(exc)
            return
        self._die(None)

    def _set_ready(self) -> None:
        with self._cond:
            self.ready.set()
            waiters, self._ready_waiters = self._ready_waiters, []
        for loop, fut in waiters:
            _resolve(loop, fut)

    def _loop(self, engine: EngineLike) -> None:
        last_tokens = _token_count(self.stats)
        while True:
            with self._cond:
                while (not self._commands and not self.stopping
                       and not engine.has_unfinished_requests()):
                    self._cond.wait()
                if self.stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
                # Adds taken off the queue count as waiting until the next stats say where
                # they are (num_waiting; at worst one step of over-count, never under).
                self._applied_adds += sum(1 for c in commands if isinstance(c, Add))
            aborted = self._apply(engine, commands)
            outputs: list[RequestOutput] = []
            stepped = False
            if engine.has_unfinished_requests():
                outputs = engine.step()
                stepped = True
            if not stepped and not aborted:
                continue  # only adds, or refused adds: nothing changed worth reporting
            # Stats and metrics first, outputs second: a client that sees its request end and
            # then reads stats() or /metrics must find it gone from the running count.
            stats = dict(engine.stats())
            with self._cond:
                self.stats = stats
                self._applied_adds = 0
            tokens = _token_count(stats)
            # Tokens the step computed (prefill chunks included); engines that do not report it
            # fall back to the change in the cumulative counts.
            step_tokens = stats.get("last_step_tokens")
            if step_tokens is None:
                step_tokens = max(tokens - last_tokens, 0)
            idle = stepped and not outputs and step_tokens == 0
            info = StepInfo(stats, outputs, aborted, step_tokens, stepped, time.monotonic())
            last_tokens = tokens
            for callback in self.callbacks:
                try:
                    callback(info)
                except Exception:  # a metrics bug must not take serving down
                    logger.exception("step callback failed")
            self._dispatch(outputs)
            if idle:
                # Nothing could be scheduled (e.g. waiting on KV space that an abort will free):
                # back off briefly instead of spinning on the CPU.
                with self._cond:
                    if not self._commands and not self.stopping:
                        self._cond.wait(0.005)

    def _fatal(self, error: BaseException) -> None:
        """From any thread: the engine thread raises `error` before its next step (one in
        flight fails by itself), so the engine dies and everything in flight gets an error."""
        with self._cond:
            self._commands.appendleft(Fatal(error))
            self._cond.notify()

    def _apply(self, engine: EngineLike, commands: list[Add | Abort | Call | Fatal]
               ) -> list[str]:
        aborted: list[str] = []
        for cmd in commands:
            if isinstance(cmd, Fatal):
                raise cmd.error
            if isinstance(cmd, Abort):
                ids = [rid for rid in cmd.request_ids if rid in self._streams]
                if ids:
                    engine.abort_request(ids)
                    for rid in ids:
                        self._streams.pop(rid).put(END)
                    aborted.extend(ids)
                continue
            # Claim the future first: once running it can no longer be cancelled by the caller,
            # so the set_result/set_exception below cannot raise InvalidStateError.
            if not cmd.future.set_running_or_notify_cancel():
                continue
            if isinstance(cmd, Call):
                try:
                    cmd.future.set_result(cmd.fn(engine))
                except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
                    cmd.future.set_exception(exc)
                continue
            if cmd.request_id in self._streams:
                cmd.future.set_exception(
                    ValueError(request_id_in_use(cmd.request_id)))
                continue
            try:
                lora: dict[str, Any] = {"lora_request": cmd.lora_request} \
                    if cmd.lora_request else {}
                if cmd.pooling_params is not None:
                    lora["pooling_params"] = cmd.pooling_params
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                   priority=cmd.priority, cache_salt=cmd.cache_salt, **lora)
            except Exception as exc:  # validation: the caller gets it, the engine goes on
                cmd.future.set_exception(exc)
                continue
            self._streams[cmd.request_id] = cmd.stream
            cmd.future.set_result(None)
        return aborted

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _die(self, exc: BaseException | None) -> None:
        """Fail everything in flight or queued, and refuse what comes later."""
        with self._cond:
            if exc is not None:
                self.dead = exc
            else:
                self.stopping = True
            commands = list(self._commands)
            self._commands.clear()
            waiters, self._ready_waiters = self._ready_waiters, []
        message = ("the engine was shut down" if exc is None
                   else f"the engine failed: {type(exc).__name__}: {exc}")
        in_flight = list(self._streams)
        for stream in self._streams.values():
            stream.put(EngineDeadError(message))
        self._streams.clear()
        for cmd in commands:
            if isinstance(cmd, (Add, Call)) and not cmd.future.done():
                cmd.future.set_exception(EngineDeadError(message))
        for loop, fut in waiters:
            _resolve(loop, fut)
        if in_flight and self.engine is not None:
            with contextlib.suppress(Exception):  # free what dead requests hold, best effort
                self.engine.abort_request(in_flight)
        if self.engine is not None and self.ready.is_set():
            # Publish the final state, so metrics do not claim those requests run forever.
            with contextlib.suppress(Exception):
                stats = dict(self.engine.stats())
                self.stats = stats
                info = StepInfo(stats, [], in_flight, 0, False, time.monotonic())
                for callback in self.callbacks:
                    callback(info)
        close = getattr(self.engine, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # the engine's sockets (KV-cache events)
                close()


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    def done() -> None:
        if not fut.done():
            fut.set_result(None)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(done)


def _token_count(stats: dict[str, Any]) -> int:
    return int(stats.get("prompt_tokens", 0) or 0) + int(stats.get("generation_tokens", 0) or 0)


def _build_engine(config: EngineConfig) -> EngineLike:
    from kserve_paged_engine.frontend.llm_engine import (
        LLMEngine,  # imported here: heavy (torch, transformers)
    )

    return LLMEngine(config)
