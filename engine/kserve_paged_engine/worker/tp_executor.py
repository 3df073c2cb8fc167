"""The tensor-parallel executor, rank 0's side: start the worker processes, load and size
them, send each step, notice when one dies, stop them.

The engine (scheduler, KV-cache manager, sampler) lives on rank 0 only. Workers
(`engine/kserve_paged_engine/worker/tp_worker.py`) hold their shard of the weights and of the paged KV cache
(the same block ids, their own KV heads) and wait for the next broadcast. Every message is a
header broadcast (`step_wire.py`); LOAD and CACHE carry one pickled dict more and end with a
gather of each rank's error, if any, so a worker that cannot load fails start-up with its
reason.

A worker that dies: its process sentinel wakes the watchdog thread, which records why and
calls `on_death` (AsyncLLM fails the engine: readiness 503, requests get an error); a step in
flight fails too, since a collective with a dead peer raises (gloo) or times out (NCCL,
`COLLECTIVE_TIMEOUT`). After any failure inside a step the ranks are out of step, so it is
`TPWorkerError` (an `ExecutorError`), fatal to the engine, never one request's error.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.distributed.ranks import (
    COLLECTIVE_TIMEOUT,
    START_TIMEOUT,
    TPRanks,
    backend_for,
    joined_key,
)
from kserve_paged_engine.model_executor.model_loader import check_tensor_parallel_folder, load_model
from kserve_paged_engine.worker import step_wire as wire
from kserve_paged_engine.worker.executor import ExecutorError
from kserve_paged_engine.worker.model_runner import ModelRunner, StepResult, step_result

logger = logging.getLogger("kserve_paged_engine")

# After a failed collective, how long to wait for a worker's exit to explain it.
DEATH_GRACE_S = 2.0
STOP_GRACE_S = 5.0


class TPWorkerError(ExecutorError):
    """A tensor-parallel worker died or a step's collectives failed: the engine cannot go on."""


class TPExecutor:
    """The N-1 worker processes of one engine, the process group they share with it, and rank
    0's runner."""

    # A pool kept across engines (tests, benchmarks): `acquire` hands it out when it fits.
    _kept: ClassVar[TPExecutor | None] = None

    def __init__(self, world_size: int, device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this "
                               "process; one tensor-parallel engine per process")
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        self.world_size = world_size
        self.device = device
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self.in_use = False
        self.failure: str | None = None
        self.runner: ModelRunner | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._stopping = False
        self._threads = torch.get_num_threads()
        # On CPU the ranks share the cores: each takes its part (TP = 2 on 2 cores: 1 each).
        threads = max(1, self._threads // world_size)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              timeout=START_TIMEOUT, wait_for_workers=False)
        from kserve_paged_engine.worker.tp_worker import worker_main

        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, name=f"kserve-paged-tp{rank}",
                                  args=(rank, world_size, store.port, device.type, threads),
                                  daemon=True)
                      for rank in range(1, world_size)]
        for p in self.procs:
            p.start()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        threading.Thread(target=self._watch, name="kserve-paged-tp-watchdog",
                         daemon=True).start()
        self._wait_joined(store)
        dist.init_process_group(backend_for(device), store=store, rank=0,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        self.group = TPRanks(0, world_size)
        logger.info("tensor parallelism: %d ranks (%s), worker pids %s", world_size,
                    backend_for(device), [p.pid for p in self.procs])

    # -- engines ------------------------------------------------------------------------------

    @classmethod
    def acquire(cls, world_size: int, device: torch.device) -> TPExecutor:
        """Workers for a new engine: the kept pool when it fits and is free, else new ones."""
        kept = cls._kept
        if (kept is not None and kept.world_size == world_size and kept.device == device
                and not kept.in_use and kept.failure is None):
            kept.in_use = True
            return kept
        workers = cls(world_size, device)
        workers.in_use = True
        return workers

    def keep(self) -> TPExecutor:
        """Keep these workers alive across engines (`close` then only releases the model)."""
        TPExecutor._kept = self
        return self

    def close(self) -> None:
        """The engine is done with them: drop the model (kept pool) or stop them."""
        self.runner = None
        if TPExecutor._kept is self and self.failure is None and not self._stopping:
            self._send(wire.RELEASE)
            self.on_death = None
            self.in_use = False
        else:
            self.stop()

    def load_model(self, path: str, dtype: torch.dtype, device: torch.device,
                   load_format: str = "auto", seed: int = 0,
                   quantization: str | None = None) -> tuple[Any, Any]:
        """Every rank loads its shard at once; rank 0's (model, config), or the first error.
        Quantized weights are not sharded (EngineConfig refuses them first)."""
        try:  # a model that cannot shard is refused before any rank loads it
            if quantization is not None:
                raise ValueError(f"quantization {quantization!r} needs tensor_parallel_size 1")
            check_tensor_parallel_folder(path, self.world_size)
        except ValueError:
            self.close()
            raise
        self._send(wire.LOAD, spec={"path": path, "dtype": dtype, "load_format": load_format,
                                    "seed": seed})
        result, error = None, None
        try:
            result = load_model(path, dtype, device, load_format, seed, tp=self.group)
        except Exception as exc:  # noqa: BLE001 - reported after the workers report theirs
            error = exc
        self._gather_errors(error, "loading the model")
        assert result is not None
        return result

    def start(self, runner: ModelRunner, **cache: Any) -> None:
        """Run steps with rank 0's `runner`; each worker builds its own: its share of the KV
        cache, the same number of blocks (`cache`: the runner's sizes)."""
        self._send(wire.CACHE, spec=cache)
        self._gather_errors(None, "allocating the KV cache")
        self.runner = runner

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Prepare the step on rank 0, broadcast it, run rank 0's share; logits gathered here."""
        assert self.runner is not None, "start() the executor first"
        inputs = self.runner.prepare(out)
        self.check_alive()
        try:
            head, payload = wire.pack(inputs, out.block_copies, self.comm_device)
            dist.broadcast(head, 0)
            dist.broadcast(payload, 0)
            outs = self.runner.forward(inputs, out.block_copies)
        except Exception as exc:
            raise self._fatal(exc) from exc
        return step_result(inputs, outs, self.runner.device)

    def check_alive(self) -> None:
        if self.failure is None:
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                self._record(dead[0])
        if self.failure is not None:
            raise TPWorkerError(self.failure)

    # -- internals ----------------------------------------------------------------------------

    def _wait_joined(self, store: dist.TCPStore) -> None:
        """Until every worker is about to join the group (each sets a key first): a worker
        that dies on the way fails start-up at once, not after the group's timeout."""
        keys = [joined_key(rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not store.check(keys):
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                for p in self.procs:
                    p.terminate()
                self._stopping = True
                self._wake_w.send(None)
                if self.device.type == "cpu":
                    torch.set_num_threads(self._threads)
                what = (f"exited with code {dead[0].exitcode}" if dead
                        else f"did not start in {START_TIMEOUT.total_seconds():.0f} s")
                raise TPWorkerError(f"a tensor-parallel worker {what} before joining the "
                                    "group (its log is above)")
            time.sleep(0.05)

    def _send(self, command: int, spec: dict[str, Any] | None = None) -> None:
        dist.broadcast(wire.header(command, device=self.comm_device), 0)
        if spec is not None:
            dist.broadcast_object_list([spec], 0)

    def _gather_errors(self, error: BaseException | None, what: str) -> None:
        errors: list[str | None] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.gather_object(mine, errors, dst=0)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        self.close()  # every rank answered: still in step, a kept pool stays usable
        if error is not None:
            raise error
        rank, message = failed[0]
        raise TPWorkerError(f"tensor-parallel rank {rank} failed {what}: {message}")

    def _fatal(self, exc: BaseException) -> TPWorkerError:
        """The error a failed step raises: the dead worker's story if there is one."""
        if self.failure is None:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.procs],
                                                    DEATH_GRACE_S)
            dead = [p for p in self.procs if p.sentinel in ready]
            if dead:
                self._record(dead[0])
        if self.failure is None:
            self.failure = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
        return TPWorkerError(self.failure)

    def _record(self, proc: Any) -> None:
        proc.join(0.1)
        rank = self.procs.index(proc) + 1
        self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}")

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait([*by_sentinel, self._wake_r])
        if self._stopping:
            return
        proc = next(by_sentinel[s] for s in ready if s in by_sentinel)
        if self.failure is None:
            self._record(proc)
        logger.error("%s", self.failure)
        if backend_for(self.device) == "nccl":
            # An NCCL collective with a dead peer would wait for its timeout: abort the
            # communicator so a step in flight raises now (gloo raises when the socket closes).
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception:  # noqa: BLE001 - best effort; the timeout remains
                logger.warning("could not abort the NCCL process group", exc_info=True)
        callback = self.on_death
        if callback is not None:
            callback(TPWorkerError(self.failure))

    def stop(self) -> None:
        """Stop the workers (STOP when they can hear it, else terminate) and the group."""
        if self._stopping:
            return
        self._stopping = True
        self._wake_w.send(None)
        if self.failure is None:
            try:
                self._send(wire.STOP)
            except Exception:  # noqa: BLE001 - a broken group: terminate below
                logger.warning("tensor-parallel workers did not take STOP; terminating them")
        for p in self.procs:
            p.join(STOP_GRACE_S)
            if p.exitcode is None:
                p.terminate()
                p.join(STOP_GRACE_S)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already broken by a dead peer
                logger.debug("destroy_process_group failed", exc_info=True)
        if self.device.type == "cpu":
            torch.set_num_threads(self._threads)
        if TPExecutor._kept is self:
            TPExecutor._kept = None
        self.in_use = False
