"""End to end with `--tensor_parallel_size 2` on CPU: the server process is rank 0, one spawned
worker rank 1 (gloo). The routes answer TP = 1's greedy text; SIGTERM drains a stream in flight
and stops the worker with the server; a worker killed mid-stream (a second server) fails that
stream with an error and turns readiness to 503 within seconds, never a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kserve_paged_engine import SamplingParams
from tests.helpers.e2e_server import ENGINE_OPTS, MODEL, Server, running_server

PROMPTS = ["The capital of France is", "1, 2, 3,"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tp_server():
    with running_server(["--tensor_parallel_size", "2"], engine_opts=ENGINE_OPTS) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(offline_llm):
    return [o.outputs[0].text for o in offline_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _worker_pids(server_pid: int) -> list[int]:
    """The server's spawned tensor-parallel workers (not multiprocessing's resource tracker)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(d.name))
    return pids


def test_tp_server_answers_openai_and_v2(tp_server: Server, reference):
    assert len(_worker_pids(tp_server.proc.pid)) == 1
    r = httpx.post(f"{tp_server.url}/openai/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                         "temperature": 0.0})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == reference
    r = httpx.post(f"{tp_server.url}/v2/models/{MODEL}/infer", timeout=120, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                    "data": [PROMPTS[0]]}],
        "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [reference[0]]
    chat = httpx.post(f"{tp_server.url}/openai/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_sigterm_drains_then_stops_the_worker(tp_server: Server):
    """Runs after the routes test: it ends the module's server."""
    (worker,) = _worker_pids(tp_server.proc.pid)
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"{tp_server.url}/openai/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first.wait(60)
    tp_server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert not thread.is_alive() and lines[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line.replace(" ", "") for line in lines)
    assert tp_server.proc.wait(60) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not _gone(worker):
        assert time.monotonic() < deadline, "the worker outlived the server"
        time.sleep(0.1)


def test_killed_worker_fails_stream_and_readiness():
    with running_server(["--tensor_parallel_size", "2"], engine_opts=ENGINE_OPTS) as srv:
        _kill_mid_stream(srv)


def _kill_mid_stream(tp_server: Server) -> None:
    worker = _worker_pids(tp_server.proc.pid)[0]
    ready_url = f"{tp_server.url}/v2/models/{MODEL}/ready"
    assert httpx.get(ready_url, timeout=10).status_code == 200
    lines: list[str] = []
    first = threading.Event()
    ended = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        try:
            with httpx.stream("POST", f"{tp_server.url}/openai/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
        except httpx.HTTPError as exc:
            lines.append(f"transport error: {exc}")
        finally:
            first.set()
            ended.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first.wait(60), "the stream never started"
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    assert ended.wait(20), "the in-flight stream hung after its worker died"
    assert any("error" in line for line in lines), lines[-3:]
    assert not any('"finish_reason":"length"' in line.replace(" ", "") for line in lines)
    while httpx.get(ready_url, timeout=10).status_code != 503:
        assert time.monotonic() - killed < 10, "readiness still 200 after a worker died"
        time.sleep(0.1)
    r = httpx.post(f"{tp_server.url}/openai/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and "tensor-parallel worker" in r.text, r.text
