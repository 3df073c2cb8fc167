"""Issue 37 part 2: hostile structured outputs and tools. Shapes that would make xgrammar slow
or overflow are refused before any parsing; a constraint that compiles too long is killed at
the deadline in its worker process and fails only its own request; a grammar that matches
nothing fails its request with 400; the compile cache is bounded in bytes."""

from __future__ import annotations

import json
import time

import pytest

from kserve_paged_engine import limits
from kserve_paged_engine.sampling_params import SamplingParams, StructuredOutputs
from tests.helpers.hostile_requests import SLOW_REGEX


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "schema-nested-5000-deep": ({"json": _deep(5000)}, "nested more than"),
    "schema-huge-enum": ({"json": {"enum": [f"v{i}" for i in range(100_000)]}}, "enum of"),
    "schema-megabyte": ({"json": {"type": "object", "description": "x" * (1 << 20)}},
                        "characters, more than"),
    "choice-100k": ({"choice": [f"c{i}" for i in range(100_000)]}, "more than"),
    "regex-megabyte": ({"regex": "a" * (1 << 20)}, "characters, more than"),
    "grammar-megabyte": ({"grammar": 'root ::= "a"' + ' | "a"' * 100_000},
                         "characters, more than"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_constraints_are_refused_before_parsing(case):
    import xgrammar  # noqa: F401 - its first import is slow; time the refusal alone

    spec, match = HOSTILE[case]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=spec)
    assert time.perf_counter() - start < 1.0


def test_limits_leave_real_schemas_alone():
    ok = StructuredOutputs(json=_deep(20))  # 20 object levels: 41 containers
    assert ok.kind == "json"
    StructuredOutputs(json={"enum": list(range(limits.MAX_ENUM_VALUES))})
    StructuredOutputs(choice=[f"c{i}" for i in range(limits.MAX_ENUM_VALUES)])


def test_ten_thousand_tools_and_deep_tool_schemas_are_400s_at_once():
    from kserve_paged.openai.errors import APIError
    from kserve_paged.openai.tools import tool_plan

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(10_000)]
    start = time.perf_counter()
    with pytest.raises(APIError, match="more than 128") as exc:
        tool_plan(tools, "required", True, "hermes")
    assert exc.value.status == 400 and time.perf_counter() - start < 0.1
    deep = [{"type": "function", "function": {"name": "f", "parameters": _deep(3000)}}]
    with pytest.raises(APIError, match="nested more than"):
        tool_plan(deep, "auto", True, "hermes")
    plan = tool_plan(tools[:limits.MAX_TOOLS], "required", True, "hermes")
    assert plan is not None and len(plan.tools) == limits.MAX_TOOLS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model(progress=lambda _: None))


@pytest.mark.slow
def test_a_compile_past_the_deadline_is_killed_and_fails_only_itself(tokenizer):
    """Long because it times one slow compile in the worker process, then checks that the
    worker restarts for the next constraint and that the slow one stays refused."""
    from kserve_paged_engine.sample.grammar_worker import GrammarCompileTimeout
    from kserve_paged_engine.sample.structured_output import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], timeout_s=3.0)
    try:
        warm = compiler.submit(StructuredOutputs(json={"type": "object"}))
        assert warm.result(timeout=300) is not None  # the worker started (not timed)
        slow = StructuredOutputs(regex=SLOW_REGEX)
        start = time.perf_counter()
        future = compiler.submit(slow)
        with pytest.raises(GrammarCompileTimeout, match="did not compile within 3 s"):
            future.result(timeout=120)
        assert time.perf_counter() - start < 20
        assert compiler._worker is not None and compiler._worker.restarts == 1
        # The next constraint compiles in a fresh worker; the slow one is refused at once.
        good = compiler.submit(StructuredOutputs(json={"type": "object", "properties": {
            "a": {"type": "integer"}}}))
        assert good.result(timeout=300) is not None
        again = compiler.submit(slow)
        assert again.done() and isinstance(again.exception(), GrammarCompileTimeout)
    finally:
        compiler.shutdown()


@pytest.mark.slow
def test_the_compile_cache_is_bounded_in_bytes(tokenizer):
    from kserve_paged_engine.sample.structured_output import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    one = compiler.submit(StructuredOutputs(json={"type": "object", "title": "0"})).result()
    size = one.memory_size_bytes
    compiler.cache_bytes = int(size * 2.5)  # room for two
    for i in range(1, 6):
        compiler.submit(StructuredOutputs(json={"type": "object", "title": str(i)})).result()
    time.sleep(0.1)  # done-callbacks run on the compile thread
    assert compiler.cached_bytes <= compiler.cache_bytes
    assert 1 <= len(compiler._sizes) <= 2
    assert json.dumps({"type": "object", "title": "5"}) in next(reversed(compiler._cache))
    compiler.shutdown()


@pytest.mark.slow
def test_a_grammar_that_matches_nothing_fails_its_request_with_400():
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.frontend.llm import LLM

    llm = LLM(model=str(ensure_default_model(progress=lambda _: None)), num_kv_blocks=64,
              max_model_len=256, dtype="float32", max_grammar_compile_s=30.0)
    engine = llm.engine
    engine.add_request("never", "Hi", SamplingParams(
        max_tokens=8, structured_outputs={"grammar": "root ::= root"}))
    engine.add_request("fine", "Hello there", SamplingParams(max_tokens=4, temperature=0))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["never"].error_status == 400
    assert "matches no text" in outputs["never"].error
    assert outputs["fine"].error is None and len(outputs["fine"].outputs[0].token_ids) == 4
    assert llm.stats()["kv_blocks_in_use"] == 0
    engine.close()


def test_a_compile_done_before_its_callback_is_added_does_not_hang_the_caller():
    """A compile can end before `submit` registers its size callback (a tiny grammar on a busy
    machine); the callback then runs in the caller's thread and must not wait on a lock the
    caller holds. A synchronous pool makes that case certain here."""
    import concurrent.futures
    import threading

    from kserve_paged_engine.sample.structured_output import GrammarCompiler

    class SyncPool:
        def submit(self, fn, *args):
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(fn(*args))
            return future

        def shutdown(self, **_):
            pass

    class Compiled:
        memory_size_bytes = 10

    compiler = GrammarCompiler(None, 8, [0])
    compiler._compile = lambda spec: Compiled()  # type: ignore[method-assign]
    compiler._pool = SyncPool()  # type: ignore[assignment]
    spec = StructuredOutputs(choice=["a", "b"])
    submitted: list[concurrent.futures.Future] = []
    caller = threading.Thread(target=lambda: submitted.append(compiler.submit(spec)),
                              daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive(), "submit hung on its own lock"
    assert submitted[0].result().memory_size_bytes == 10
    assert compiler.cached_bytes == 10  # the callback ran and counted it
    assert compiler.submit(spec) is submitted[0]  # cached
