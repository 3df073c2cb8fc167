"""One launcher for server processes: the e2e tests' server and the benchmarks' servers.

`ServerProcess` starts a server command, polls its readiness URLs from the moment the process
starts (recording every answer, so a test can check it went not-ready -> ready), reports the
time to ready (process start -> every readiness URL answering 200, in order: ours
/v2/models/<name>/ready; vLLM /health, then /v1/models, since vLLM's /health can answer before
its API routes are usable), and stops it. By default the server runs in its own session, so
stopping it signals the whole process group: vLLM's engine-core and worker processes go with
it. With `own_session=False` (the e2e tests) it stays in the caller's process group instead, so
a signal to that group (Ctrl-C, `timeout`) reaches the server too and never leaves it running.
Test and benchmark tooling only: the server itself never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A loopback port that was free a moment ago (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_code(url: str, timeout: float = 2.0) -> int:
    """The HTTP status a GET of `url` answers with; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def _group_pids(pgid: int) -> list[int]:
    """The live processes of one process group (read from /proc; Linux only)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after "(comm)": state, ppid, pgrp, ...
            pids.append(int(d.name))
    return pids


class ServerProcess:
    """A server subprocess with its time to ready; use as a context manager to always stop it."""

    def __init__(self, cmd: Sequence[str], ready_urls: Sequence[str], *,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 cwd: str | Path | None = None, timeout_s: float = 600.0,
                 poll_s: float = 0.25, own_session: bool = True) -> None:
        self.cmd = list(cmd)
        self.ready_urls = list(ready_urls)
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.cwd = cwd
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.own_session = own_session
        self.proc: subprocess.Popen | None = None
        self.time_to_ready_s: float | None = None
        # (seconds since start, status code or 0 when nothing answered), one per poll
        self.ready_history: list[tuple[float, int]] = []
        self._log = None
        self._seen: set[int] = set()

    def start(self) -> float:
        """Start the process and block until ready; returns seconds from spawn to ready."""
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        out = self._log or subprocess.DEVNULL
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=out,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=self.own_session)
        pending = list(self.ready_urls)
        while pending:
            if self.own_session:
                self._seen.update(_group_pids(self.proc.pid))
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"ready; log: {self.log_path}\n{self.tail()}")
            if time.perf_counter() - t0 > self.timeout_s:
                self.stop()
                raise TimeoutError(f"server not ready after {self.timeout_s:.0f} s "
                                   f"(waiting for {pending[0]}); log: {self.log_path}\n"
                                   f"{self.tail()}")
            code = status_code(pending[0])
            self.ready_history.append((time.perf_counter() - t0, code))
            if code == 200:
                pending.pop(0)
                continue
            time.sleep(self.poll_s)
        self.time_to_ready_s = time.perf_counter() - t0
        return self.time_to_ready_s

    def log(self) -> str:
        """The server's output so far ("" without a log file)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group (the process alone without its own session), SIGKILL what
        is left after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if not self.own_session:
            return self._stop_process(grace_s)
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        self._seen.update(_group_pids(pgid))
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.proc.wait()
        # Children may outlive the leader for a moment; give them the same treatment.
        deadline = time.monotonic() + grace_s
        while _group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            if _group_pids(pgid):
                os.killpg(pgid, signal.SIGKILL)
        # Intel OpenMP (preloaded for vLLM) leaves a registration file per process when
        # stopped by a signal; remove only those of the processes we started.
        for pid in self._seen:
            for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        self._close_log()
        return self.proc.returncode

    def _stop_process(self, grace_s: float) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
