"""Real server processes for the e2e tests (their fixtures are in e2e/conftest.py), on loopback.

``python -m kserve_paged`` runs on free ports through the shared launcher
(``kserve_paged.testing.ServerProcess``, which the benchmarks use too): it polls the model's
ready route from the moment the process starts (tests check that it went not-ready -> ready)
and stops the process at the end. Its log goes to a file that is printed when startup fails
and kept when the server did not exit cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kserve_paged.testing import ServerProcess, free_port

MODEL = "smol"
ENGINE_OPTS = {"max_model_len": 1024, "num_kv_blocks": 256}
STARTUP_TIMEOUT_S = float(os.environ.get("E2E_STARTUP_TIMEOUT", "240"))
STOP_GRACE_S = 40.0


@dataclass
class Server:
    process: ServerProcess
    http_port: int
    grpc_port: int

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.process.proc is not None
        return self.process.proc

    @property
    def log_path(self) -> Path:
        assert self.process.log_path is not None
        return self.process.log_path

    @property
    def ready_history(self) -> list[tuple[float, int]]:
        """(seconds since start, status code or 0 when the connection was refused)."""
        return self.process.ready_history

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def http_host(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_host(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.process.log()


def launch(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
           engine_opts: dict[str, int] | None = None) -> Server:
    """Start ``python -m kserve_paged`` on loopback (HTTP on 127.0.0.1, gRPC off unless asked)
    and wait until the model is ready."""
    opts = ENGINE_OPTS if engine_opts is None else engine_opts
    extra = list(extra_args or [])
    http_port, grpc_port = free_port(), free_port()
    fd, log_name = tempfile.mkstemp(prefix="kserve-paged-e2e-", suffix=".log")
    os.close(fd)
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", MODEL,
           "--http_host", "127.0.0.1", "--http_port", str(http_port),
           "--grpc_port", str(grpc_port)]
    for name, value in opts.items():
        cmd += [f"--{name}", str(value)]
    if "--enable_grpc" not in extra:
        cmd += ["--enable_grpc", "false"]
    cmd += extra
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = ServerProcess(cmd, [f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/ready"],
                            env=full_env, log_path=log_name, timeout_s=STARTUP_TIMEOUT_S,
                            poll_s=0.1, own_session=False)
    srv = Server(process, http_port, grpc_port)
    try:
        process.start()
    except (RuntimeError, TimeoutError) as exc:
        shutdown(srv)
        pytest.fail(f"{str(exc).splitlines()[0]}\n{srv.log()[-5000:]}")
    except BaseException:
        shutdown(srv)
        raise
    return srv


def shutdown(srv: Server) -> None:
    """Stop the process (SIGTERM, then SIGKILL); keep its log only when it did not exit
    cleanly."""
    srv.process.stop(grace_s=STOP_GRACE_S)
    with contextlib.suppress(OSError):
        if srv.process.proc is not None and srv.proc.returncode in (0, -signal.SIGTERM):
            os.unlink(srv.log_path)


@contextlib.contextmanager
def running_server(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                   engine_opts: dict[str, int] | None = None) -> Iterator[Server]:
    """A server process for one test module (see :func:`launch`)."""
    srv = launch(extra_args, env, engine_opts)
    try:
        yield srv
    finally:
        shutdown(srv)


# -- helpers for the reliability suites ------------------------------------------------------

def scrape(srv: Server) -> dict[str, float]:
    """``/metrics`` as {sample name: value} for this model's unlabelled-by-anything-else series
    (histogram buckets and info series are left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels == {"model_name": MODEL}:
                values[sample.name] = sample.value
    return values


def wait_idle(srv: Server, timeout: float) -> tuple[float, dict[str, float]]:
    """Poll until no request runs or waits and no KV block is held; returns (seconds it took,
    last scrape). Fails the test after ``timeout`` seconds."""
    start = time.monotonic()
    while True:
        m = scrape(srv)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return time.monotonic() - start, m
        if time.monotonic() - start > timeout:
            pytest.fail(f"engine not idle after {timeout}s: running "
                        f"{m['vllm:num_requests_running']}, waiting "
                        f"{m['vllm:num_requests_waiting']}, kv {m['vllm:kv_cache_usage_perc']}")
        time.sleep(0.05)


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """Resident memory of a process from /proc/<pid>/status (VmRSS now, VmHWM peak)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def record(name: str, **figures: Any) -> None:
    """Append one line of figures to $RELIABILITY_FIGURES (JSON lines), for RELIABILITY.md."""
    path = os.environ.get("RELIABILITY_FIGURES")
    if not path:
        return
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"test": name, **figures}) + "\n")

