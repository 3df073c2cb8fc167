"""One child process for the tests that run the engine on the GPU path without a GPU: Triton
interpreted (compiled when CUDA is present), the Triton backend forced, kept alive for the whole
test session so torch, transformers and Triton are imported once, not once per test file.

Why a child at all: tests/kernels/interpreted.py (TRITON_INTERPRET must be set before Triton is
imported). Why one: each of tests/test_triton_engine.py, test_host_syncs.py, test_warmup.py and
test_launch_count.py started its own, and the imports were a third of their time on two cores.

The tests ask for a function of a bench script (`bench/` is on the child's path) or of a test
helper, by module and name, with JSON keyword arguments; the child seeds torch's generator
before each call (a call sees what a fresh process would) and answers one JSON line. A failing
call is an error for its test only; a crash or a timeout ends the child and the next call starts
another. `tests/conftest.py`'s `gpu_path` fixture holds the session's worker.

Child: `python -m tests.helpers.gpu_path_worker` (requests on stdin, answers on stdout).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class GpuPathWorker:
    """The test side: starts the child on first use, sends calls, caches their answers."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None
        self._answers: dict[str, Any] = {}

    def call(self, module: str, func: str, timeout: float = 600, **kwargs: Any) -> Any:
        """`module.func(**kwargs)` in the child (once per session per arguments)."""
        key = json.dumps([module, func, kwargs], sort_keys=True)
        if key not in self._answers:
            self._answers[key] = self._ask(key, timeout)
        return self._answers[key]

    def _start(self) -> subprocess.Popen[str]:
        from tests.kernels.interpreted import child_env

        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by close()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.gpu_path_worker"], cwd=REPO,
                env=child_env(KSERVE_PAGED_ATTENTION_BACKEND="triton", HF_HUB_OFFLINE="1"),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        return self._proc

    def _ask(self, request: str, timeout: float) -> Any:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(request + "\n")
        proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            tail = self._tail()
            self.close()
            raise AssertionError(f"the GPU-path worker {'timed out' if not ready else 'died'} "
                                 f"on {request}:\n{tail}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise AssertionError(f"{request} failed in the GPU-path worker:\n{answer['error']}")
        return answer["result"]

    def _tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:]

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()  # it holds nothing to save; its interpreter's exit alone takes seconds
            proc.wait()
            if proc.stdin:
                proc.stdin.close()
            if proc.stdout:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


def _serve() -> None:
    """The child: one JSON request per stdin line, one answer per stdout line; what the called
    code prints goes to stderr."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from kserve_paged_kernels.testing import faithful_interpreter

        faithful_interpreter()  # every call sees the same interpreter, whatever ran before
    import importlib

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        module, func, kwargs = json.loads(line)
        t0 = time.monotonic()
        torch.manual_seed(0)
        try:
            answer = {"ok": True,
                      "result": getattr(importlib.import_module(module), func)(**kwargs)}
        except Exception:  # noqa: BLE001 - the test that asked reports it
            answer = {"ok": False, "error": traceback.format_exc()[-4000:]}
        print(f"{module}.{func}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
