"""Issue 37 part 2's spare compile worker: a grammar child killed at the deadline (or dead) is
replaced by a spare started beforehand, so the next constraint compiles without waiting for a
process to start, and another spare starts in its place. Shown by which processes do the work,
not by timing."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kserve_paged_engine.sample.grammar_worker import CompileWorker, GrammarCompileTimeout
from kserve_paged_engine.sampling_params import StructuredOutputs

pytestmark = pytest.mark.slow  # each child imports xgrammar: seconds per start

STARTUP_S = 300.0  # a loaded machine; only a bound on waiting, nothing is timed
CHOICE = StructuredOutputs(choice=["ab", "b"])


@pytest.fixture
def worker():
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(["a", "b", "ab", "</s>"], stop_token_ids=[3])  # a tiny vocabulary
    w = CompileWorker(info, timeout_s=STARTUP_S)
    yield w
    w.close()


def _ready_spare(w: CompileWorker):
    assert w.spare is not None
    return w.spare.result(timeout=STARTUP_S)  # its child has read the tokenizer


def test_a_child_killed_at_the_deadline_is_replaced_by_the_ready_spare(worker):
    assert worker.compile(CHOICE) is not None
    first = worker._proc
    spare = worker.spare
    spare_proc = _ready_spare(worker)
    assert spare_proc.pid != first.pid and spare_proc.poll() is None

    worker.timeout_s = 1e-9  # no child answers that fast: this compile is killed
    with pytest.raises(GrammarCompileTimeout):
        worker.compile(StructuredOutputs(regex="[ab]{1,8}"))
    assert first.poll() is not None and worker.pid is None and worker.restarts == 1
    assert worker.spare is spare and spare.done()  # the replacement is already running

    worker.timeout_s = STARTUP_S
    assert worker.compile(CHOICE) is not None
    assert worker.pid == spare_proc.pid  # the spare compiled it: no process start waited for
    assert worker.spare is not spare  # and the next spare was started in its place
    new_spare = _ready_spare(worker)
    assert new_spare.pid not in (first.pid, spare_proc.pid) and new_spare.poll() is None


def test_a_child_that_died_idle_is_replaced_by_the_spare(worker):
    worker.start()
    dead = worker._proc
    spare_proc = _ready_spare(worker)
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    assert worker.compile(CHOICE) is not None
    assert worker.pid == spare_proc.pid and worker.restarts == 1


def test_close_ends_every_child_the_starting_spare_included(worker):
    worker.start()
    end = time.monotonic() + STARTUP_S
    while len(worker._children) < 2:  # the spare's process exists (it may still be starting)
        assert time.monotonic() < end, "no spare was started"
        time.sleep(0.01)
    children = list(worker._children)
    assert worker.pid in {p.pid for p in children}
    worker.close()
    assert all(p.poll() is not None for p in children)
    assert not worker._children
