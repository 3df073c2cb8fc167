"""Rank 0's watch over its tensor-parallel workers (engine/kserve_paged_engine/worker/tp_watchdog.py),
with plain child processes standing in for the workers: a death is recorded and reported once,
an expected exit (after stop) is not, and a failed step names the worker that died."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from kserve_paged_engine.worker import tp_watchdog
from kserve_paged_engine.worker.tp_watchdog import TPWorkerError, WorkerWatch

CPU = torch.device("cpu")


def _child(code: int) -> multiprocessing.Process:
    """A forked child that exits with `code` once `release()` is called."""
    read, write = multiprocessing.Pipe(duplex=False)

    def run() -> None:
        read.recv()
        os._exit(code)

    proc = multiprocessing.get_context("fork").Process(target=run, daemon=True)
    proc.start()
    proc.release = lambda: write.send(None)  # type: ignore[attr-defined]
    return proc


def test_a_dead_worker_is_recorded_and_reported_once() -> None:
    proc = _child(3)
    watch = WorkerWatch([proc], CPU)
    heard: list[BaseException] = []
    told = threading.Event()
    watch.on_death = lambda exc: (heard.append(exc), told.set())
    watch.check_alive()  # alive: nothing to say
    proc.release()
    assert told.wait(30)
    want = f"tensor-parallel worker rank 1 (pid {proc.pid}) exited with code 3"
    assert watch.failure == want
    assert len(heard) == 1 and isinstance(heard[0], TPWorkerError) and str(heard[0]) == want
    with pytest.raises(TPWorkerError, match="rank 1 .* exited with code 3"):
        watch.check_alive()


def test_an_exit_after_stop_is_no_failure() -> None:
    proc = _child(0)
    watch = WorkerWatch([proc], CPU)
    heard: list[BaseException] = []
    watch.on_death = heard.append
    watch.stop()
    proc.release()
    proc.join(30)
    time.sleep(0.1)  # let a (wrong) report from the watch thread land before we look
    assert watch.failure is None and heard == []


def test_a_failed_step_names_the_dead_worker_or_else_the_step_error(monkeypatch) -> None:
    monkeypatch.setattr(tp_watchdog, "DEATH_GRACE_S", 0.01)
    alive = _child(0)
    watch = WorkerWatch([alive], CPU)
    error = watch.fatal(RuntimeError("connection reset"))
    assert str(error) == "tensor-parallel step failed: RuntimeError: connection reset"
    watch.stop()
    alive.release()

    dying = _child(9)
    watch = WorkerWatch([dying], CPU)
    watch.stop()  # the thread stays quiet: fatal alone must find the death
    dying.release()
    dying.join(30)
    monkeypatch.setattr(tp_watchdog, "DEATH_GRACE_S", 30.0)
    assert "rank 1" in str(watch.fatal(RuntimeError("connection reset")))
