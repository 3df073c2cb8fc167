"""Issue 37 part 3, through the server in process: --max_waiting_requests answers 429 with
Retry-After (and counts it), and a request's deadline (body timeout, x-request-timeout,
--request_timeout_s) aborts it wherever it is: 408, or an error event once streaming."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from prometheus_client import generate_latest

from kserve_paged_engine.outputs import RequestOutput
from tests.helpers.server import FakeEngine, client, ready, run, sse

CMPL = "/openai/v1/completions"
V2 = "/v2/models/m/infer"
V1 = "/v1/models/m:predict"


class GatedEngine(FakeEngine):
    """Runs at most ``capacity`` requests; the rest wait (reported as num_waiting). Running
    ones make a token per step only while ``gate`` is set; a step takes ``step_s``."""

    def __init__(self, capacity: int = 1, step_s: float = 0.02) -> None:
        super().__init__()
        self.capacity = capacity
        self.step_s = step_s
        self.gate = threading.Event()
        self.aborted: list[str] = []

    def _running(self) -> list[str]:
        return list(self.reqs)[:self.capacity]

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        if not self.gate.is_set():
            return []
        running = set(self._running())
        waiting = {rid: r for rid, r in self.reqs.items() if rid not in running}
        for rid in waiting:
            del self.reqs[rid]
        try:
            return super().step()
        finally:
            self.reqs.update(waiting)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted += [rid for rid in ids if rid in self.reqs]
        super().abort_request(ids)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        running = len(self._running())
        s.update(num_running=running, num_waiting=len(self.reqs) - running,
                 kv_usage=running / 32)
        return s


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "a b", "max_tokens": 4, **fields}


def _v2(text: str = "a b", **parameters: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                        "data": [text]}], "parameters": {"max_tokens": 2, **parameters}}


def _v1_or_v2(route: str, **parameters: Any) -> dict[str, Any]:
    if route == V2:
        return _v2(**parameters)
    return {"instances": ["a b"], "parameters": {"max_tokens": 2, **parameters}}


async def _until(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


def _metric(model, name: str) -> float:
    text = generate_latest(model.test_registry).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_a_full_waiting_queue_answers_429_with_retry_after_and_counts_it():
    async def main() -> None:
        engine = GatedEngine(capacity=1)
        app, model, _ = await ready(engine)
        model.max_waiting_requests = 2
        async with client(app) as c:
            # One at a time, each seen by the engine before the next: which request runs and
            # which wait must not depend on the order the three tasks reach the engine.
            first = asyncio.ensure_future(c.post(CMPL, json=_body()))
            await _until(lambda: model.llm.stats().get("num_running") == 1
                         and model.llm.num_waiting == 0)
            queued = []
            for n in (1, 2):
                queued.append(asyncio.ensure_future(c.post(CMPL, json=_body())))
                await _until(lambda n=n: model.llm.num_waiting == n)
            r = await c.post(CMPL, json=_body())
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert "--max_waiting_requests 2" in err["message"]
            assert err["type"] == "rate_limit_error"
            r = await c.post(V2, json=_v2())
            assert r.status_code == 429 and "waiting" in r.json()["error"]
            r = await c.post(CMPL, json=_body(stream=True))
            assert r.status_code == 429  # refused before the stream starts
            assert _metric(model, "vllm:num_requests_rejected_total") == 3
            engine.gate.set()
            for f in (first, *queued):
                assert (await f).status_code == 200
            r = await c.post(CMPL, json=_body())  # room again
            assert r.status_code == 200
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("how", ["body", "header", "server-default"])
def test_a_deadline_aborts_a_request_and_answers_408(how):
    async def main() -> None:
        engine = GatedEngine(capacity=1)
        options = {"request_timeout_s": 0.3} if how == "server-default" else {}
        app, model, _ = await ready(engine, **options)
        body = _body(timeout=0.3) if how == "body" else _body()
        headers = {"x-request-timeout": "0.3"} if how == "header" else {}
        async with client(app) as c:
            start = time.monotonic()
            r = await c.post(CMPL, json=body, headers=headers)  # the gate stays shut
            took = time.monotonic() - start
            assert r.status_code == 408, r.text
            assert "deadline" in r.json()["error"]["message"]
            assert 0.25 < took < 5
            await _until(lambda: not engine.reqs)  # aborted in the engine: nothing held
            assert len(engine.aborted) == 1
            if how != "body":  # the header and the default reach v2 as well
                r = await c.post(V2, json=_v2(), headers=headers)
                assert r.status_code == 408 and "deadline" in r.json()["error"]
            await _until(lambda: not engine.reqs)
            assert _metric(model, "vllm:num_requests_timed_out_total") == (
                1 if how == "body" else 2)
            engine.gate.set()
            r = await c.post(CMPL, json=_body(timeout=30), headers={"x-request-timeout": "30"}
                             if how == "header" else {})
            assert r.status_code == 200  # time to spare: served as usual
        model.stop_engine()
    run(main())


def test_a_stream_past_its_deadline_ends_with_an_error_event():
    async def main() -> None:
        engine = GatedEngine(capacity=1, step_s=0.05)
        engine.gate.set()
        app, model, _ = await ready(engine)
        async with client(app) as c:
            r = await c.post(CMPL, json=_body(stream=True, max_tokens=50),
                             headers={"x-request-timeout": "0.5"})
            assert r.status_code == 200
            events = sse(r.text)
            assert any(e.get("choices") for e in events)  # it streamed, then
            assert "deadline" in events[-1]["error"]["message"]  # it was cut at the deadline
            await _until(lambda: not engine.reqs)
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", "1e9"])
def test_a_malformed_timeout_is_a_400(bad):
    async def main() -> None:
        app, model, engine = await ready(GatedEngine())
        async with client(app) as c:
            r = await c.post(CMPL, json=_body(), headers={"x-request-timeout": bad})
            assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]["message"]
            r = await c.post(V2, json=_v2(), headers={"x-request-timeout": bad})
            assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]
            value: Any = float(bad) if bad not in ("abc", "nan", "inf") else bad
            r = await c.post(CMPL, json=_body(timeout=value))
            assert r.status_code == 400 and "timeout" in r.json()["error"]["message"]
            assert not engine.added  # refused before anything was queued
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("route", [V2, V1])
def test_the_v2_timeout_parameter_aborts_a_request_and_answers_408(route):
    """Triton's ``parameters.timeout`` (microseconds), the deadline of KServe's v1/v2 routes;
    the earliest deadline wins, so a longer header does not extend it."""
    async def main() -> None:
        engine = GatedEngine(capacity=1)
        app, model, _ = await ready(engine)
        async with client(app) as c:
            start = time.monotonic()
            r = await c.post(route, json=_v1_or_v2(route, timeout=300_000),
                             headers={"x-request-timeout": "30"})  # the gate stays shut
            took = time.monotonic() - start
            assert r.status_code == 408, r.text
            assert "deadline" in r.json()["error"]
            assert 0.25 < took < 5
            await _until(lambda: not engine.reqs)  # aborted in the engine: nothing held
            assert len(engine.aborted) == 1
            assert _metric(model, "vllm:num_requests_timed_out_total") == 1
            engine.gate.set()
            for timeout in (30_000_000, "30000000", 0):  # time to spare; 0: none (Triton's)
                r = await c.post(route, json=_v1_or_v2(route, timeout=timeout))
                assert r.status_code == 200, r.text
            assert _metric(model, "vllm:num_requests_timed_out_total") == 1
        model.stop_engine()
    run(main())


@pytest.mark.parametrize("bad", [-1, 1.5, "0.5", "abc", True, 86_400_000_001])
def test_a_malformed_v2_timeout_parameter_is_a_400_before_anything_is_queued(bad):
    async def main() -> None:
        app, model, engine = await ready(GatedEngine())
        async with client(app) as c:
            for route in (V2, V1):
                r = await c.post(route, json=_v1_or_v2(route, timeout=bad))
                assert r.status_code == 400, r.text
                message = r.json()["error"]
                assert "parameters.timeout" in message and "microseconds" in message
            assert not engine.added
        model.stop_engine()
    run(main())


def test_the_flags_parse():
    from kserve_paged.args import parse_args

    args = parse_args(["--max_waiting_requests", "8", "--request_timeout_s", "2.5",
                       "--max_grammar_compile_s", "4"])
    assert (args.max_waiting_requests, args.request_timeout_s) == (8, 2.5)
    assert parse_args([]).max_waiting_requests is None
    assert parse_args([]).request_timeout_s is None
    for bad in (["--max_waiting_requests", "0"], ["--request_timeout_s", "-1"],
                ["--max_grammar_compile_s", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
