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
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    http_port, grpc_port = free_port(), free_port()
    fd, log_name = tempfile.mkstemp(prefix="kserve-paged-e2e-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", MODEL,
           "--http_port", str(http_port), "--grpc_port", str(grpc_port),
           "--max_model_len", str(ENGINE_OPTS["max_model_len"]),
           "--num_kv_blocks", str(ENGINE_OPTS["num_kv_blocks"])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
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
        yield srv
    finally:
        _stop(proc)
        log_file.close()
        with contextlib.suppress(OSError):
            if proc.returncode in (0, -signal.SIGTERM):
                os.unlink(log_name)


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine with the server's options: the reference for greedy outputs."""
    from engine import LLM

    return LLM(**ENGINE_OPTS)
