"""Preemption by swap (engine/kserve_paged_engine/core/kv_tier/swap.py): a victim's KV, partial last block included,
written to the second tier when it is preempted and restored when it resumes, so it continues
token for token as if it had never been preempted; the cost model recomputes when copying is
slower than prefill; a tier that cannot hold the blocks, or whose writes fail, recomputes and
the answer is still exact.

What holds on every machine type (AVX2-only, AVX-512 without bf16, AVX512-BF16, AMX): a swap
restores the very bytes the victim computed, so its continuation is the one of a run that was
never preempted, in float32 and bfloat16 alike (the two prompts on a pool that holds both).
That reference batches the victim's later steps with the other request where the swapped run
computes them alone: the native kernels sum each row in an order that does not depend on the
batch's other rows, at every ISA level (kernels/kserve_paged_kernels/csrc/gemm_bf16.c), as the float32 tests of
preemption already rely on.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from kserve_paged_engine import SamplingParams
from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from kserve_paged_engine.core.kv_tier.swap import Swapper
from tests.helpers.kv_tier_engine import FLOODS, PROMPT, Fixed, engine, tier_dirs

LONG = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
PROMPTS = [PROMPT, FLOODS[0]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tier_dirs(tmp_path_factory)


def stub_rates(llm, write: float = 1e9, read: float = 1e9, prefill: float = 1e3) -> None:
    """Rates the engine's measurements do not move (bytes/s, bytes/s, tokens/s)."""
    tier = llm.engine.kv_tier
    tier.writer.write_rate, tier.read_rate = Fixed(write, True), Fixed(read, True)
    llm.engine.kv.tier.swaps.prefill = Fixed(prefill, True)


def generate(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, LONG, use_tqdm=False)]


@pytest.fixture(scope="module")
def never_preempted(dirs):
    """Each dtype's outputs on a pool that holds both requests (no preemption)."""
    want = {}
    for dtype in ("float32", "bfloat16"):
        llm = engine(dirs, dtype, None, num_kv_blocks=64)
        want[dtype] = generate(llm)
        assert llm.stats()["num_preemptions"] == 0
    return want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_swapped_request_continues_as_if_never_preempted(dirs, never_preempted,
                                                          tmp_path, dtype, caplog):
    llm = engine(dirs, dtype, tmp_path)
    stub_rates(llm, prefill=10.0)  # a slow prefill: every preemption swaps
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        assert generate(llm) == never_preempted[dtype]
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["kv_swap_outs"] == s["num_preemptions"]
    assert s["kv_swap_ins"] == s["kv_swap_outs"] and s["kv_swap_short"] == 0
    assert s["num_requests_swapped"] == 0
    assert "swap: the copy is cheaper" in caplog.text
    kv = llm.engine.kv
    assert kv.pool.num_used_blocks == 0 and not llm.engine.kv_tier.private  # nothing leaked
    llm.engine.close()


def test_slow_copies_make_the_cost_model_recompute(dirs, never_preempted, tmp_path,
                                                   caplog):
    """A recomputed victim still comes back partly by copy: its full blocks stay cached when
    freed and return through the prefix lookup (from the pool, or from the tier where the
    other request's growth evicted them); only the rest is computed."""
    llm = engine(dirs, "float32", tmp_path)
    stub_rates(llm, write=1e3)  # a disk of 1 kB/s
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        assert generate(llm) == never_preempted["float32"]
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["kv_swap_outs"] == 0
    assert s["kv_swap_recomputes"] == s["num_preemptions"]
    assert "recompute: the prefill is cheaper" in caplog.text
    assert s["kv_tier_block_hits"] > 0  # the victim's full blocks, back from the tier
    llm.engine.close()


def failing_writes(monkeypatch, gate: threading.Event | None = None) -> None:
    """Every tier write fails (a full disk), once `gate` is set if one is given: until then
    the writer thread waits in its first write and every later one stays queued."""
    import kserve_paged_engine.core.kv_tier.files as files

    def broken(*args, **kwargs):
        if gate is not None:
            gate.wait()
        raise OSError("no space left on device")

    monkeypatch.setattr(files, "write_block", broken)


def writes_done_after_each_step(llm) -> None:
    """The tier writer finishes a step's writes before the next step looks anything up (on
    its own thread it may still be writing then: a lookup reads a queued block's bytes)."""
    eng, step = llm.engine, llm.engine.step

    def stepped():
        try:
            return step()
        finally:
            eng.kv_tier.writer.flush()

    eng.step = stepped


def test_a_tier_too_small_or_failing_recomputes_with_the_right_answer(
        dirs, never_preempted, tmp_path, monkeypatch):
    small = engine(dirs, "float32", tmp_path / "small")
    stub_rates(small, prefill=10.0)
    small.engine.kv_tier.capacity_blocks = 1  # holds no victim's blocks
    assert generate(small) == never_preempted["float32"]
    s = small.stats()
    assert s["num_preemptions"] > 0 and s["kv_swap_outs"] == 0
    small.engine.close()

    failing_writes(monkeypatch)
    failing = engine(dirs, "float32", tmp_path / "failing")
    stub_rates(failing, prefill=10.0)
    writes_done_after_each_step(failing)  # each write has failed before the victim resumes
    assert generate(failing) == never_preempted["float32"]
    s = failing.stats()
    # The swap's writes failed: it resumed short (what was lost computed again), and the
    # next preemption recomputes.
    assert s["kv_swap_outs"] == 1 and s["kv_swap_short"] == 1 and s["kv_swap_ins"] == 0
    assert failing.engine.kv.tier.swaps.choose(40, 1, 1).why == (
        "recompute: a tier write failed recently")
    assert failing.engine.kv.pool.num_used_blocks == 0
    failing.engine.close()


def test_a_swap_read_back_before_its_failing_writes_ran_resumes_whole(
        dirs, never_preempted, tmp_path, monkeypatch):
    """The tier writer is a thread: a write that will fail may still be queued when the
    victim resumes, and the lookup then reads the queued bytes (the very bytes copied out of
    the pool). That is a whole swap-in, counted as one; only a write that has failed by then
    loses its block."""
    gate = threading.Event()
    failing_writes(monkeypatch, gate)
    llm = engine(dirs, "float32", tmp_path)
    stub_rates(llm, prefill=10.0)
    try:
        assert generate(llm) == never_preempted["float32"]
        s = llm.stats()
        assert s["kv_swap_outs"] > 0 and s["kv_swap_ins"] == s["kv_swap_outs"]
        assert s["kv_swap_short"] == 0 and s["num_requests_swapped"] == 0
        assert llm.engine.kv_tier.writer.errors == 0  # not one write has failed yet
    finally:
        gate.set()
    llm.engine.kv_tier.writer.flush()
    assert llm.engine.kv_tier.writer.errors > 0
    assert llm.engine.kv.tier.swaps.choose(40, 1, 1).why == (
        "recompute: a tier write failed recently")
    llm.engine.close()


def test_a_swapped_request_that_ends_while_waiting_is_counted_dropped(dirs, tmp_path):
    """Every swap-out ends as one of ins, short or dropped: an abort while swapped is no
    swap-in, and its record and tier blocks go."""
    llm = engine(dirs, "float32", tmp_path)
    stub_rates(llm, prefill=10.0)
    eng, swaps = llm.engine, llm.engine.kv.tier.swaps
    for prompt in PROMPTS:
        eng.add_request(eng.next_request_id(), prompt, LONG)
    while not swaps.swapped:  # up to the step that swaps the victim out
        assert eng.has_unfinished_requests()
        eng.step()
    (victim,) = swaps.swapped
    eng.abort_request(victim)
    while eng.has_unfinished_requests():
        eng.step()
    s = llm.stats()
    assert s["kv_swap_outs"] == 1 and s["kv_swap_dropped"] == 1
    assert s["kv_swap_ins"] == s["kv_swap_short"] == 0 and s["num_requests_swapped"] == 0
    assert eng.kv.pool.num_used_blocks == 0 and not eng.kv_tier.private
    eng.close()


def test_the_cost_model_weighs_measured_rates(tmp_path: Path):
    tier = DiskTier(tmp_path, 1000, 100_000, 4)
    swaps = Swapper(tier, 4)
    tier.writer.write_rate = MeasuredRate(1e6, measured=True)
    tier.read_rate = MeasuredRate(1e6, measured=True)
    swaps.prefill = MeasuredRate(100.0, measured=True)
    c = swaps.choose(tokens=40, blocks_out=10, blocks_in=10)  # 20 ms of copies, 400 ms prefill
    assert c.swap and c.swap_s == pytest.approx(0.02) and c.recompute_s == pytest.approx(0.4)
    swaps.prefill = MeasuredRate(1e5, measured=True)  # 0.4 ms of prefill
    assert not swaps.choose(40, 10, 10).swap
    swaps.prefill.observe(1, 1.0)  # a measurement moves the mean, not replaces it
    assert swaps.prefill.value == pytest.approx(0.75 * 1e5 + 0.25)
    assert not swaps.choose(40, 101, 101).swap  # more than the tier holds
    tier.close()
