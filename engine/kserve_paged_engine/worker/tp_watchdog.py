"""Rank 0's watch over its tensor-parallel workers (`tp_executor.py`): notice one that dies
or a worker node that falls silent, record why, and fail the engine.

A worker that dies: its process sentinel wakes the watchdog thread, which records why and
calls `on_death` (AsyncLLM fails the engine: readiness 503, requests get an error); a step in
flight fails too, since a collective with a dead peer raises (gloo) or times out (NCCL,
`COLLECTIVE_TIMEOUT`; the watchdog aborts the communicator so it raises now). After any
failure inside a step the ranks are out of step, so it is `TPWorkerError` (an
`ExecutorError`), fatal to the engine, never one request's error.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
from collections.abc import Callable
from typing import Any

import torch

from kserve_paged_engine.distributed.node_heartbeat import watch_nodes
from kserve_paged_engine.distributed.ranks import backend_for
from kserve_paged_engine.worker.executor import ExecutorError

logger = logging.getLogger("kserve_paged_engine")

# After a failed collective, how long to wait for a worker's exit to explain it.
DEATH_GRACE_S = 2.0


class TPWorkerError(ExecutorError):
    """A tensor-parallel worker died or a step's collectives failed: the engine cannot go on."""


class WorkerWatch:
    """The first failure of a group (`failure`) and who hears of it (`on_death`); watches
    `procs` (this pod's worker processes) from a thread from the start."""

    def __init__(self, procs: list[Any], device: torch.device) -> None:
        self.procs = procs
        self.device = device
        self.failure: str | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.stopping = False
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        threading.Thread(target=self._watch, name="kserve-paged-tp-watchdog",
                         daemon=True).start()

    def watch_nodes(self, store_port: int, remote: dict[int, str]) -> None:
        """Also watch the worker nodes' heartbeats (`remote`: node -> its ranks, in words)."""
        threading.Thread(target=watch_nodes, name="kserve-paged-node-watch", daemon=True,
                         args=(store_port, remote, self._stopped, self._node_silent)).start()

    def stop(self) -> None:
        """The group is being stopped: exits from now on are expected, not failures."""
        self.stopping = True
        self._wake_w.send(None)
        self._stopped.set()

    def check_alive(self) -> None:
        if self.failure is None:
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                self._record(dead[0])
        if self.failure is not None:
            raise TPWorkerError(self.failure)

    def fatal(self, exc: BaseException) -> TPWorkerError:
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
        if self.stopping:
            return
        proc = next(by_sentinel[s] for s in ready if s in by_sentinel)
        if self.failure is None:
            self._record(proc)
        self._fail_engine()

    def _node_silent(self, reason: str) -> None:
        """A worker node stopped beating (distributed/node_heartbeat.py)."""
        if self.stopping or self.failure is not None:
            return
        self.failure = reason
        self._fail_engine()

    def _fail_engine(self) -> None:
        """`self.failure` is set: break a step in flight and tell the engine."""
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
