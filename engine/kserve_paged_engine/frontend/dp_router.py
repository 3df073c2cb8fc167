"""Data parallelism inside one server (vLLM's `--data-parallel-size`): N engine replicas, each
an :class:`AsyncLLM` with its own engine thread, scheduler, KV cache and model copy, behind one
AsyncLLM-shaped face, so the server serves them all from one endpoint.

- Routing: a request goes to the live replica with the fewest unfinished requests (running +
  waiting; the router counts its own, from the add until the replica's step reports the
  request finished or aborted, so a burst spreads before any step ran); ties to the lowest
  index.
- Health: ready when every replica is; one dead replica fails readiness with a reason naming it
  (as vLLM's data-parallel engines end together).
- Stats: one snapshot summed over replicas (usage fractions averaged, shape facts from replica
  0), and step callbacks see that sum, serialized, so counters stay monotonic.
- Adapters load into every replica (a failed load is undone on those that took it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.async_llm import AsyncLLM, EngineDeadError, EngineLike, StepInfo
from kserve_paged_engine.frontend.request_stream import RequestStream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

logger = logging.getLogger("kserve_paged_engine")

# Stats that describe a replica's shape, the same in each: replica 0's value, not a sum.
SHAPE_STATS = frozenset({"block_size", "num_kv_blocks", "max_lora"})


class ReplicaDeadError(RuntimeError):
    """A data-parallel replica's engine died; the message names the replica."""


def check_data_parallel(size: int, tensor_parallel_size: int, multi_node: object) -> None:
    """ValueError for a data-parallel layout that is not built (the one home of these rules)."""
    if size < 1:
        raise ValueError(f"data_parallel_size must be >= 1 (got {size})")
    if size > 1 and tensor_parallel_size > 1:
        raise ValueError(f"data_parallel_size {size} with tensor_parallel_size "
                         f"{tensor_parallel_size} is not built: each replica would be a "
                         "tensor-parallel group; run data parallelism at tensor_parallel_size "
                         "1, or tensor parallelism alone")
    if size > 1 and multi_node is not None:
        raise ValueError(f"data_parallel_size {size} over several pods (nnodes) is not built: "
                         "data parallelism runs within one pod")


def replica_configs(config: EngineConfig, size: int) -> list[EngineConfig]:
    """Each replica's config: on CUDA replica r on GPU r; on CPU the same config (threads are
    split by the engine factory, `replica_builders`). ValueError for a layout that cannot run."""
    check_data_parallel(size, config.tensor_parallel_size, config.multi_node)
    if size == 1 or not config._on_gpu():
        return [config] * size
    import torch

    if config.device not in ("auto", "cuda"):
        raise ValueError(f"data_parallel_size {size} places replica r on cuda:r; --device "
                         f"{config.device} names one GPU (use cuda or auto)")
    if torch.cuda.device_count() < size:
        raise ValueError(f"data_parallel_size {size} needs {size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    return [dataclasses.replace(config, device=f"cuda:{r}") for r in range(size)]


def replica_builders(configs: Sequence[EngineConfig], threads: int | None,
                     factory: Callable[[], EngineLike] | None = None
                     ) -> list[Callable[[], EngineLike]]:
    """Each replica's engine factory. On CPU (`threads` given) it sets the engine thread's
    torch threads first, so N replicas share the cores instead of each taking all of them.
    Replica 0 builds alone, the others once it is built: the first build imports the model
    code (transformers' lazy modules are not safe to import from two threads at once)."""
    first_built = threading.Event()

    def builder(index: int, config: EngineConfig) -> Callable[[], EngineLike]:
        def build() -> EngineLike:
            if index > 0:
                first_built.wait()
            try:
                import torch

                if threads is not None:
                    torch.set_num_threads(threads)
                if config.device.startswith("cuda:"):
                    # The engine thread's current device: its kernels, streams, graph
                    # captures and memory profile would otherwise all be cuda:0's.
                    torch.cuda.set_device(torch.device(config.device))
                if factory is not None:
                    return factory()
                from kserve_paged_engine.frontend.llm_engine import LLMEngine

                return LLMEngine(config)
            finally:
                if index == 0:
                    first_built.set()
        return build
    return [builder(index, config) for index, config in enumerate(configs)]


class DataParallelLLM:
    """N AsyncLLM replicas behind the AsyncLLM surface the server uses (module docstring)."""

    def __init__(self, replicas: Sequence[AsyncLLM]) -> None:
        if not replicas:
            raise ValueError("DataParallelLLM needs at least one replica")
        self.replicas = list(replicas)
        self.config = self.replicas[0].config
        self.routed = [0] * len(self.replicas)  # requests sent to each replica so far
        self._unfinished: list[set[str]] = [set() for _ in self.replicas]
        self._ids = itertools.count()
        self._callbacks: list[Callable[[StepInfo], None]] = []
        self._stats_lock = threading.Lock()  # one summed snapshot fed to callbacks at a time
        for index, replica in enumerate(self.replicas):
            replica.add_step_callback(self._step_of(index))

    @classmethod
    def from_config(cls, config: EngineConfig, size: int, *,
                    engine_factory: Callable[[], EngineLike] | None = None) -> DataParallelLLM:
        """`size` replicas of `config` (replica_configs); on CPU each gets threads / size."""
        import torch

        configs = replica_configs(config, size)
        threads = None if config._on_gpu() else max(1, torch.get_num_threads() // size)
        builders = replica_builders(configs, threads, engine_factory)
        logger.info("data parallel: %d engine replicas (%s)", size,
                    f"{threads} torch threads each" if threads is not None
                    else ", ".join(c.device for c in configs))
        return cls([AsyncLLM(c, engine_factory=build)
                    for c, build in zip(configs, builders, strict=True)])

    # -- lifecycle and health ---------------------------------------------------------------

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    async def wait_ready(self) -> None:
        """Return once every replica serves; EngineDeadError naming the first that failed."""
        results = await asyncio.gather(*(r.wait_ready() for r in self.replicas),
                                       return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                raise EngineDeadError(f"data-parallel replica {index}: {result}") from result

    @property
    def is_ready(self) -> bool:
        return all(r.is_ready for r in self.replicas)

    def is_healthy(self) -> bool:
        return all(r.is_healthy() for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        """The first dead replica's error, named (None while all are alive)."""
        for index, replica in enumerate(self.replicas):
            if replica.error is not None:
                return ReplicaDeadError(f"data-parallel replica {index} of "
                                        f"{len(self.replicas)} died: {replica.error!r}")
        return None

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def engine(self) -> EngineLike:
        return self.replicas[0].engine

    def model_info(self) -> ModelInfo:
        return self.replicas[0].model_info()

    # -- stats and step callbacks -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return sum_stats([r.stats() for r in self.replicas])

    def add_step_callback(self, callback: Callable[[StepInfo], None]) -> None:
        self._callbacks.append(callback)

    def _step_of(self, index: int) -> Callable[[StepInfo], None]:
        def on_step(info: StepInfo) -> None:
            ended = [o.request_id for o in info.outputs if o.finished] + list(info.aborted)
            with self._stats_lock:
                self._unfinished[index].difference_update(ended)
                summed = dataclasses.replace(info, stats=self.stats())
                for callback in self._callbacks:
                    callback(summed)
        return on_step

    # -- requests ---------------------------------------------------------------------------

    def load(self, index: int) -> int:
        """Requests routed to replica `index` and not ended yet (running + waiting)."""
        with self._stats_lock:
            return len(self._unfinished[index])

    def pick(self) -> int:
        """The live replica with the fewest unfinished requests (ties: lowest index)."""
        live = [i for i, r in enumerate(self.replicas) if r.is_healthy()] or [0]
        return min(live, key=lambda i: (self.load(i), i))

    async def add(self, prompt: str | list[int], params: SamplingParams,
                  request_id: str | None = None, *, priority: int = 0,
                  cache_salt: str | None = None,
                  lora_request: LoRARequest | None = None, deadline: float | None = None,
                  on_deadline: Callable[[], None] | None = None,
                  pooling_params: PoolingParams | None = None) -> RequestStream:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        index = self.pick()
        self.routed[index] += 1
        with self._stats_lock:
            self._unfinished[index].add(request_id)
        try:
            return await self.replicas[index].add(
                prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                lora_request=lora_request, deadline=deadline, on_deadline=on_deadline,
                pooling_params=pooling_params)
        except BaseException:  # refused or cancelled: it holds nothing there
            with self._stats_lock:
                self._unfinished[index].discard(request_id)
            raise

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add(prompt, params, request_id, priority=priority,
                                cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call_engine(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(engine)` on every replica's engine thread; the results in replica order."""
        return list(await asyncio.gather(*(r.call_engine(fn) for r in self.replicas)))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load into every replica; if one refuses, unload it from the others and re-raise."""
        results = await asyncio.gather(*(r.add_lora(lora_request) for r in self.replicas),
                                       return_exceptions=True)
        failed = next((x for x in results if isinstance(x, BaseException)), None)
        if failed is None:
            return all(results)
        for replica, result in zip(self.replicas, results, strict=True):
            if not isinstance(result, BaseException):
                # An engine that is gone or never held it: nothing to undo.
                with contextlib.suppress(ValueError, EngineDeadError):
                    await replica.remove_lora(lora_request.lora_int_id)
        raise failed

    async def remove_lora(self, lora_int_id: int) -> bool:
        results = await asyncio.gather(*(r.remove_lora(lora_int_id) for r in self.replicas))
        return any(results)

    async def abort(self, request_id: str | list[str]) -> None:
        """Unknown ids are ignored by each replica, so the abort goes to all."""
        for replica in self.replicas:
            await replica.abort(request_id)


def sum_stats(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One stats dict for all replicas: numbers summed (lists element by element), `*_usage`
    fractions averaged, adapter-name lists joined, SHAPE_STATS from the first replica."""
    total: dict[str, Any] = {}
    seen: dict[str, int] = {}  # replicas that reported each key (for the averages)
    for snapshot in snapshots:
        for key, value in snapshot.items():
            seen[key] = seen.get(key, 0) + 1
            if key not in total:
                total[key] = list(value) if isinstance(value, list) else value
            elif key in SHAPE_STATS or value is None:
                continue
            elif isinstance(value, str):
                names = {n for n in (total[key] or "").split(",") + value.split(",") if n}
                total[key] = ",".join(sorted(names))
            elif isinstance(value, list):
                prev = total[key]
                total[key] = [a + b for a, b in zip(prev, value, strict=False)] + (
                    prev[len(value):] if len(prev) > len(value) else list(value[len(prev):]))
            elif isinstance(value, (int, float)) and isinstance(total[key], (int, float)):
                total[key] = total[key] + value
    for key, value in total.items():
        if key.endswith("_usage") and isinstance(value, (int, float)):
            total[key] = value / seen[key]
    return total
