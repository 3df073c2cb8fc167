"""AsyncLLM: the engine thread, the hand-off to asyncio, aborts and failure handling.

Most tests use a small fake engine (fast, deterministic); one runs the real engine on the default
model and compares with the offline LLM.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest

from kserve_paged_engine.frontend.async_llm import AsyncLLM, EngineDeadError, StepInfo
from kserve_paged_engine.limits import request_id_in_use
from kserve_paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kserve_paged_engine.sampling_params import SamplingParams


class FakeEngine:
    """One token per step per request; token i of a request is ``i``, its text ``"<i>"``."""

    def __init__(self, step_delay: float = 0.0, max_model_len: int = 64) -> None:
        self.reqs: dict[str, dict[str, Any]] = {}
        self.step_delay = step_delay
        self.max_model_len = max_model_len
        self.fail_next_step: BaseException | None = None
        self.steps = 0
        self.aborted: list[str] = []
        self.threads: set[str] = set()
        self.generation_tokens = 0
        self.prompt_tokens = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        self.threads.add(threading.current_thread().name)
        ids = list(prompt) if isinstance(prompt, list) else [1] * len(prompt.split())
        if not ids:
            raise ValueError("the prompt is empty: at least one token is required")
        if request_id in self.reqs:
            raise ValueError(request_id_in_use(request_id))
        if len(ids) > self.max_model_len:
            raise ValueError("prompt too long")
        self.reqs[request_id] = {"prompt": ids, "out": [], "params": params,
                                 "metrics": RequestMetrics(time.monotonic())}

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        now = time.monotonic()
        for rid, r in list(self.reqs.items()):
            m = r["metrics"]
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                self.prompt_tokens += len(r["prompt"])
            tok = len(r["out"])
            r["out"].append(tok)
            self.generation_tokens += 1
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            done = len(r["out"]) >= r["params"].max_tokens
            if done:
                m.finished_time = now
                del self.reqs[rid]
            text = "".join(f"<{t}>" for t in r["out"])
            outputs.append(RequestOutput(
                rid, None, r["prompt"],
                [CompletionOutput(0, text, list(r["out"]), "length" if done else None,
                                  delta_text=f"<{tok}>", delta_token_ids=[tok])],
                done, 0, m))
        return outputs

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.reqs), "num_waiting": 0,
                "kv_usage": 0.1 * len(self.reqs), "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens}

    def warmup(self) -> None:
        self.warmed = True


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


async def started(engine: FakeEngine, **kwargs: Any) -> AsyncLLM:
    llm = AsyncLLM(engine=engine, **kwargs)
    llm.start()
    await llm.wait_ready()
    return llm


async def collect(llm: AsyncLLM, prompt: Any, max_tokens: int, rid: str) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, SamplingParams(max_tokens=max_tokens), rid)]


def test_streams_outputs_and_runs_engine_on_its_own_thread():
    async def main() -> None:
        engine = FakeEngine()
        llm = await started(engine)
        assert llm.is_ready and llm.is_healthy() and engine.warmed
        outs = await collect(llm, [1, 2, 3], 4, "a")
        assert [o.outputs[0].delta_token_ids for o in outs] == [[0], [1], [2], [3]]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert engine.threads == {"kserve-paged-engine"}
        assert llm.stats()["generation_tokens"] == 4
        llm.shutdown()
        assert not llm.is_healthy()
    run(main())


def test_concurrent_requests_are_batched():
    async def main() -> None:
        engine = FakeEngine()
        llm = await started(engine)
        results = await asyncio.gather(*(collect(llm, [1], n, f"r{n}") for n in (3, 5, 7)))
        assert [len(r) for r in results] == [3, 5, 7]
        assert engine.steps <= 7 + 2  # they shared steps
        llm.shutdown()
    run(main())


def test_validation_errors_reach_the_caller_and_engine_goes_on():
    async def main() -> None:
        llm = await started(FakeEngine(step_delay=0.002, max_model_len=4))
        with pytest.raises(ValueError, match="empty"):
            await collect(llm, [], 2, "e")
        with pytest.raises(ValueError, match="too long"):
            await llm.add([1] * 10, SamplingParams(max_tokens=2), "long")
        stream = await llm.add([1], SamplingParams(max_tokens=10_000), "dup")
        with pytest.raises(ValueError, match=re.escape(request_id_in_use("dup"))):
            await llm.add([1], SamplingParams(max_tokens=2), "dup")
        await stream.aclose()
        assert len(await collect(llm, [1], 2, "ok")) == 2
        llm.shutdown()
    run(main())


def test_consumer_that_stops_iterating_aborts_within_a_step():
    async def main() -> None:
        engine = FakeEngine(step_delay=0.01)
        llm = await started(engine)
        gen = llm.generate([1], SamplingParams(max_tokens=1000), "gone")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            if "gone" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["gone"] and not engine.reqs
        llm.shutdown()
    run(main())


def test_cancelled_consumer_task_aborts():
    async def main() -> None:
        engine = FakeEngine(step_delay=0.01)
        llm = await started(engine)
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate([1], SamplingParams(max_tokens=1000), "cancelled"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not engine.reqs:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["cancelled"]
        llm.shutdown()
    run(main())


def test_explicit_abort_ends_the_stream():
    async def main() -> None:
        engine = FakeEngine(step_delay=0.005)
        llm = await started(engine)
        got = []

        async def consume() -> None:
            async for out in llm.generate([1], SamplingParams(max_tokens=1000), "x"):
                got.append(out)
                if len(got) == 2:
                    await llm.abort("x")

        await consume()
        assert 2 <= len(got) < 1000 and engine.aborted == ["x"]
        await llm.abort("unknown")  # ignored
        llm.shutdown()
    run(main())


def test_engine_failure_fails_requests_and_marks_unhealthy():
    async def main() -> None:
        engine = FakeEngine(step_delay=0.005)
        llm = await started(engine)

        async def consume() -> list[RequestOutput]:
            return await collect(llm, [1], 1000, "doomed")

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        engine.fail_next_step = RuntimeError("CUDA exploded")
        with pytest.raises(EngineDeadError, match="CUDA exploded"):
            await task
        assert not llm.is_healthy() and not llm.is_ready
        with pytest.raises(EngineDeadError):
            await collect(llm, [1], 2, "after")
    run(main())


def test_a_fatal_report_from_another_thread_fails_the_engine_even_while_idle():
    """What a dead tensor-parallel worker does (engine/kserve_paged_engine/worker/tp_executor.py): the engine's
    `on_fatal` callback, called from the watchdog thread, fails everything in flight and the
    engine stays unhealthy, whether or not a step is running."""
    class WatchedEngine(FakeEngine):
        report = None

        def on_fatal(self, callback) -> None:
            self.report = callback

    async def main() -> None:
        engine = WatchedEngine(step_delay=0.005)
        llm = await started(engine)
        task = asyncio.create_task(collect(llm, [1], 1000, "in-flight"))
        await asyncio.sleep(0.05)
        threading.Thread(target=engine.report,
                         args=(RuntimeError("worker rank 1 exited with code -9"),)).start()
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            await task
        assert not llm.is_ready and "worker rank 1" in str(llm.error)

        idle = WatchedEngine()
        llm = await started(idle)
        assert llm.is_ready
        threading.Thread(target=idle.report, args=(RuntimeError("gone"),)).start()
        for _ in range(200):
            if not llm.is_ready:
                break
            await asyncio.sleep(0.01)
        assert not llm.is_ready and not llm.is_healthy()
    run(main())


def test_load_failure_is_reported_by_wait_ready():
    async def main() -> None:
        def factory() -> FakeEngine:
            raise OSError("no weights here")

        llm = AsyncLLM(engine_factory=factory)
        llm.start()
        with pytest.raises(EngineDeadError, match="no weights"):
            await llm.wait_ready()
        assert not llm.is_healthy()
    run(main())


def test_idle_engine_thread_sleeps():
    async def main() -> None:
        engine = FakeEngine()
        llm = await started(engine)
        await collect(llm, [1], 2, "warm")
        steps = engine.steps
        t0 = time.process_time()
        await asyncio.sleep(0.3)
        assert engine.steps == steps
        assert time.process_time() - t0 < 0.1  # no busy spin
        llm.shutdown()
    run(main())


def test_step_callback_sees_every_step_and_aborts():
    async def main() -> None:
        infos: list[StepInfo] = []
        engine = FakeEngine(step_delay=0.005)
        llm = await started(engine, step_callback=infos.append)
        await collect(llm, [1, 2], 3, "cb")
        stepped = [i for i in infos if i.stepped]
        assert len(stepped) == 3 and stepped[-1].stats["num_running"] == 0
        assert sum(i.num_tokens for i in stepped) == 2 + 3  # prompt + generated
        stream = await llm.add([1], SamplingParams(max_tokens=1000), "ab")
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if any("ab" in i.aborted for i in infos):
                break
            await asyncio.sleep(0.01)
        last = infos[-1]
        assert "ab" in last.aborted and last.stats["num_running"] == 0
        llm.shutdown()
    run(main())


def test_shutdown_fails_in_flight_requests():
    async def main() -> None:
        llm = await started(FakeEngine(step_delay=0.005))
        stream = await llm.add([1], SamplingParams(max_tokens=10_000), "long")
        await stream.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
    run(main())


@pytest.mark.slow
@pytest.mark.slow
def test_real_engine_matches_offline_llm():
    """The tiny real engine: streamed greedy output equals LLM.generate's."""
    from kserve_paged_engine import LLM, EngineConfig

    opts = {"max_model_len": 256, "num_kv_blocks": 64}
    prompts = ["The capital of France is", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    offline = [o.outputs[0] for o in LLM(**opts).generate(prompts, params, use_tqdm=False)]

    async def main() -> list[tuple[str, list[int], str]]:
        llm = AsyncLLM(EngineConfig(**opts))
        llm.start()
        await llm.wait_ready()

        async def one(i: int, p: str) -> tuple[str, list[int], str]:
            deltas = []
            final = None
            async for out in llm.generate(p, params, f"p{i}"):
                deltas.append(out.outputs[0].delta_text)
                final = out
            assert final is not None and final.finished
            return final.outputs[0].text, final.outputs[0].token_ids, "".join(deltas)

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            assert llm.stats()["num_running"] == 0
            llm.shutdown()

    got = asyncio.run(asyncio.wait_for(main(), 300))
    for (text, ids, joined), ref in zip(got, offline):
        assert ids == ref.token_ids and text == ref.text == joined


def test_add_cancelled_while_the_engine_thread_handles_it_does_not_kill_the_engine():
    class SlowAdd(FakeEngine):
        def __init__(self) -> None:
            super().__init__(step_delay=0.002)
            self.entered = threading.Event()
            self.release = threading.Event()

        def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
            if request_id == "slow":
                self.entered.set()
                self.release.wait(5)
            super().add_request(request_id, *args, **kwargs)

    async def main() -> None:
        engine = SlowAdd()
        llm = await started(engine)
        task = asyncio.create_task(llm.add([1], SamplingParams(max_tokens=1000), "slow"))
        while not engine.entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()  # the caller gives up while the engine thread is inside add_request
        await asyncio.sleep(0.02)
        engine.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(await collect(llm, [1], 3, "after")) == 3
        assert llm.is_healthy()
        for _ in range(100):  # the orphaned request is aborted, not left running
            if not engine.reqs:
                break
            await asyncio.sleep(0.01)
        assert not engine.reqs
        llm.shutdown()
    run(main())
