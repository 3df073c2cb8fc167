"""The native LoRA SGMV (kernels/kserve_paged_kernels/cpu_native/lora.py, csrc/lora_sgmv.c) against
kserve_paged_kernels.reference.lora_sgmv_ref, and the engine's CPU path through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.reference import lora_sgmv_ref
from kserve_paged_kernels.testing import LORA_CASES, make_lora_case


@pytest.fixture(autouse=True)
def _native_library_built() -> None:
    # gcc is part of the supported machine (README): a missing build must fail, not skip.
    assert cpu_native.load() is not None, "the native library did not build"


@pytest.mark.parametrize(("name", "seg_lens", "slots", "ranks", "in_f", "out_f"), LORA_CASES,
                         ids=[c[0] for c in LORA_CASES])
@pytest.mark.parametrize("threads", [1, 2])
def test_sgmv_matches_the_reference(name, seg_lens, slots, ranks, in_f, out_f, threads):
    case = make_lora_case(seg_lens, slots, ranks, in_f, out_f, torch.float32,
                          total_rows=sum(seg_lens) + 5)
    want = {k: v.clone() for k, v in case.items()}
    untouched = sorted(set(range(case["x"].shape[0])) - set(case["rows"].tolist()))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_native.lora_sgmv(**case) is True
    finally:
        torch.set_num_threads(before)
    lora_sgmv_ref(**want)
    torch.testing.assert_close(case["out"], want["out"], atol=1e-5, rtol=1e-5)
    assert torch.equal(case["out"][untouched], want["out"][untouched])


def test_a_long_prefill_runs_in_parallel_and_matches():
    """Enough rows to cross the kernel's parallel threshold, with segments of three slots."""
    case = make_lora_case([300, 1, 211], [2, 0, 1], [8, 16, 64], 256, 384, torch.float32,
                          total_rows=600, seed=3)
    want = {k: v.clone() for k, v in case.items()}
    assert cpu_native.lora_sgmv(**case) is True
    lora_sgmv_ref(**want)
    torch.testing.assert_close(case["out"], want["out"], atol=1e-4, rtol=1e-4)


def test_bad_rows_segments_and_slots_are_refused_and_change_nothing():
    case = make_lora_case([3, 2], [0, 1], [8, 8], 32, 48, torch.float32, total_rows=8)
    before = case["out"].clone()
    for key, value in (("rows", torch.tensor([0, 1, 2, 3, 99])),
                       ("seg_slot", torch.tensor([0, 2])),
                       ("seg_len", torch.tensor([3, 3]))):
        with pytest.raises(IndexError):
            cpu_native.lora_sgmv(**{**case, key: value})
        assert torch.equal(case["out"], before)
    with pytest.raises(ValueError, match="disagree"):
        cpu_native.lora_sgmv(**{**case, "x": case["x"][:, :16]})


def test_what_the_kernel_does_not_take_is_left_to_torch():
    """bf16 tensors, and ranks above the kernel's limit: None, nothing written."""
    bf16 = make_lora_case([2], [0], [8], 32, 32, torch.bfloat16, total_rows=4)
    before = bf16["out"].clone()
    assert cpu_native.lora_sgmv(**bf16) is None
    assert torch.equal(bf16["out"], before)
    wide = make_lora_case([1], [0], [cpu_native.abi.LORA_MAX_RANK + 1], 8, 8, torch.float32,
                          total_rows=2)
    assert cpu_native.lora_sgmv(**wide) is None


def test_the_engines_cpu_step_gives_the_per_adapter_torch_delta(monkeypatch):
    """engine/kserve_paged_engine/lora/batch.py with the native backend: adapters of different ranks in slots, one
    adapting a projection the other does not, rows of a mixed step, against the torch loop."""
    from kserve_paged_engine.lora.adapter import LoRAAdapter, LoRAWeights
    from kserve_paged_engine.lora.batch import (
        LoRAStep,
        SlotStacks,
        add_lora_delta,
        group_rows,
        sgmv_step,
    )

    g = torch.Generator().manual_seed(1)
    calls = []
    kernel = cpu_native.lora_sgmv_segments
    monkeypatch.setattr(cpu_native, "lora_sgmv_segments",
                        lambda *a: calls.append(kernel(*a)) or calls[-1])

    def weights(rank: int, in_f: int, out_f: int) -> LoRAWeights:
        return LoRAWeights(torch.randn(rank, in_f, generator=g) * 0.1,
                           torch.randn(out_f, rank, generator=g) * 0.1)

    qkv, down = (0, "self_attn.qkv_proj"), (0, "mlp.down_proj")
    one = LoRAAdapter("one", 8, {qkv: weights(24, 64, 96), down: weights(8, 80, 64)})
    two = LoRAAdapter("two", 4, {qkv: weights(12, 64, 96)})
    rows, runs = group_rows(np.array([0, 2, 1, 1, 0, 2, 2, 1, 0], dtype=np.int64))
    by_id = {1: one, 2: two}
    segments = [(by_id[i], s, e) for i, s, e in runs]
    torch_step = LoRAStep(torch.from_numpy(rows), segments)
    native_step = LoRAStep(torch.from_numpy(rows), segments,
                           sgmv_step(segments, SlotStacks((one, two), rank_major=True), torch.device("cpu"),
                                     "native"))
    for key, in_f, out_f in ((qkv, 64, 96), (down, 80, 64)):
        x = torch.randn(9, in_f, generator=g)
        base = torch.randn(9, out_f, generator=g)
        want, got = base.clone(), base.clone()
        add_lora_delta(x, want, torch_step, key)
        add_lora_delta(x, got, native_step, key)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[[0, 4, 8]], base[[0, 4, 8]])
    assert calls == [True, True]  # one native call per projection, the torch loop not used
