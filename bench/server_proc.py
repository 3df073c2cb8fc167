"""Launch a server command, time it to ready, and stop it (with all its children) afterwards.

Time to ready is process start -> every readiness URL answering 200, in order (ours:
/v2/models/<name>/ready; vLLM: /health, then /v1/models, since vLLM's /health can answer before
its API routes are usable). The server runs in its own session, so stopping it signals the whole
process group: vLLM's engine-core and worker processes go with it.

    python bench/server_proc.py --ready /v2/models/smol/ready -- \
        .venv/bin/python -m kserve_paged --model_name smol --http_port {port}

`{port}` in the command is replaced by a free loopback port.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
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


def answers_200(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


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
                 poll_s: float = 0.25) -> None:
        self.cmd = list(cmd)
        self.ready_urls = list(ready_urls)
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.cwd = cwd
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.proc: subprocess.Popen | None = None
        self.time_to_ready_s: float | None = None
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
                                     stderr=subprocess.STDOUT, start_new_session=True)
        pending = list(self.ready_urls)
        while pending:
            self._seen.update(_group_pids(self.proc.pid))
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"ready; log: {self.log_path}\n{self.tail()}")
            if time.perf_counter() - t0 > self.timeout_s:
                self.stop()
                raise TimeoutError(f"server not ready after {self.timeout_s:.0f} s "
                                   f"(waiting for {pending[0]}); log: {self.log_path}")
            if answers_200(pending[0]):
                pending.pop(0)
                continue
            time.sleep(self.poll_s)
        self.time_to_ready_s = time.perf_counter() - t0
        return self.time_to_ready_s

    def tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
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
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time a server command to ready, then stop it.")
    ap.add_argument("--ready", action="append", required=True,
                    help="readiness path (or full URL); repeat for several, checked in order")
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--log", default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the server command after --")
    port = args.port or free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    urls = [u if "://" in u else f"http://127.0.0.1:{port}{u}" for u in args.ready]
    with ServerProcess(cmd, urls, log_path=args.log, timeout_s=args.timeout) as srv:
        print(f"ready after {srv.time_to_ready_s:.2f} s (port {port})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
