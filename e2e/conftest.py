"""The e2e fixture: one real server process on the default model per session, on loopback.

``python -m kserve_paged`` runs on free ports; the fixture polls the model's ready route from
the moment the process starts (tests check that it went not-ready -> ready), and kills the
process at the end. Its log goes to a file that is printed when startup fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "smol"
ENGINE_OPTS = {"max_model_len": 1024, "num_kv_blocks": 256}
STARTUP_TIMEOUT_S = float(os.environ.get("E2E_STARTUP_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log_path: Path
    # (seconds since start, status code or 0 when the connection was refused)
    ready_history: list[tuple[float, int]] = field(default_factory=list)

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
        return self.log_path.read_text(errors="replace")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def launch(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
           engine_opts: dict[str, int] | None = None) -> tuple[Server, Any]:
    """Start ``python -m kserve_paged`` on loopback (HTTP on 127.0.0.1, gRPC off unless asked)
    and wait until the model is ready; returns the server and its open log file."""
    opts = ENGINE_OPTS if engine_opts is None else engine_opts
    extra = list(extra_args or [])
    http_port, grpc_port = free_port(), free_port()
    fd, log_name = tempfile.mkstemp(prefix="kserve-paged-e2e-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", MODEL,
           "--http_host", "127.0.0.1", "--http_port", str(http_port),
           "--grpc_port", str(grpc_port)]
    for name, value in opts.items():
        cmd += [f"--{name}", str(value)]
    if "--enable_grpc" not in extra:
        cmd += ["--enable_grpc", "false"]
    cmd += extra
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    srv = Server(proc, http_port, grpc_port, Path(log_name))
    start = time.monotonic()
    try:
        with httpx.Client(timeout=5) as client:
            while True:
                elapsed = time.monotonic() - start
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{srv.log()[-5000:]}")
                if elapsed > STARTUP_TIMEOUT_S:
                    pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S}s:\n"
                                f"{srv.log()[-5000:]}")
                try:
                    code = client.get(f"{srv.url}/v2/models/{MODEL}/ready").status_code
                except httpx.TransportError:
                    code = 0
                srv.ready_history.append((elapsed, code))
                if code == 200:
                    break
                time.sleep(0.1)
    except BaseException:
        shutdown(srv, log_file)
        raise
    return srv, log_file


def shutdown(srv: Server, log_file: Any) -> None:
    """Stop the process (SIGTERM, then SIGKILL); keep its log only when it did not exit
    cleanly."""
    _stop(srv.proc)
    log_file.close()
    with contextlib.suppress(OSError):
        if srv.proc.returncode in (0, -signal.SIGTERM):
            os.unlink(srv.log_path)


@contextlib.contextmanager
def running_server(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                   engine_opts: dict[str, int] | None = None) -> Iterator[Server]:
    """A server process for one test module (see :func:`launch`)."""
    srv, log_file = launch(extra_args, env, engine_opts)
    try:
        yield srv
    finally:
        shutdown(srv, log_file)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with running_server(["--enable_grpc", "true"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine with the server's options: the reference for greedy outputs."""
    from engine import LLM

    return LLM(**ENGINE_OPTS)


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

