"""Triton SGMV shrink/expand (kernels/kserve_paged_kernels/lora_triton.py) against kserve_paged_kernels.reference.lora_sgmv_ref.

Without CUDA the kernels run in Triton's interpreter (the `triton_interpreter` fixture);
shapes are kept small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kserve_paged_kernels.reference import lora_sgmv_ref
from kserve_paged_kernels.testing import LORA_CASES, make_lora_case

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("lt")  # every test runs with the kernels loadable


@pytest.fixture(scope="module")
def lt(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.lora_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "seg_lens", "slots", "ranks", "in_f", "out_f"), LORA_CASES,
                         ids=[c[0] for c in LORA_CASES])
def test_sgmv_matches_the_reference(lt, name, seg_lens, slots, ranks, in_f, out_f, dtype):
    case = make_lora_case(seg_lens, slots, ranks, in_f, out_f, dtype,
                          total_rows=sum(seg_lens) + 5, device=DEVICE)
    want = {k: v.clone() for k, v in case.items()}
    untouched = sorted(set(range(case["x"].shape[0])) - set(case["rows"].tolist()))
    lt.lora_sgmv(**case, max_seg_len=max(seg_lens))
    lora_sgmv_ref(**{k: want[k] for k in want})
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(case["out"].float().cpu(), want["out"].float().cpu(),
                               atol=atol, rtol=atol)
    # Rows outside every segment are left as they were.
    assert torch.equal(case["out"][untouched].cpu(), want["out"][untouched].cpu())


def test_an_empty_step_changes_nothing(lt):
    case = make_lora_case([2], [0], [8], 32, 32, torch.float32, total_rows=4, device=DEVICE)
    before = case["out"].clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    lt.lora_sgmv(case["x"], case["out"], case["a_stack"], case["b_stack"], case["scales"],
                 empty, empty, empty, empty, max_seg_len=0)
    assert torch.equal(case["out"], before)


def test_the_engines_sgmv_step_gives_the_per_adapter_torch_delta():
    """engine/kserve_paged_engine/lora/batch.py on its CUDA path (here in the interpreter): adapters stacked into
    slots with different ranks, one adapting a projection the other does not, rows of a
    mixed step (no adapter, adapter 1, adapter 2) against the per-adapter torch matmuls."""
    from kserve_paged_engine.lora.adapter import LoRAAdapter, LoRAWeights
    from kserve_paged_engine.lora.batch import (
        LoRAStep,
        SlotStacks,
        add_lora_delta,
        group_rows,
        sgmv_step,
    )

    g = torch.Generator().manual_seed(1)

    def weights(rank: int, in_f: int, out_f: int) -> LoRAWeights:
        return LoRAWeights(torch.randn(rank, in_f, generator=g) * 0.1,
                           torch.randn(out_f, rank, generator=g) * 0.1)

    qkv, down = (0, "self_attn.qkv_proj"), (0, "mlp.down_proj")
    one = LoRAAdapter("one", 8, {qkv: weights(24, 64, 96), down: weights(8, 80, 64)})
    two = LoRAAdapter("two", 4, {qkv: weights(12, 64, 96)})  # no delta on down_proj
    rows, runs = group_rows(np.array([0, 2, 1, 1, 0, 2, 2, 1, 0], dtype=np.int64))
    by_id = {1: one, 2: two}
    segments = [(by_id[i], s, e) for i, s, e in runs]
    torch_step = LoRAStep(torch.from_numpy(rows), segments)
    triton_step = LoRAStep(torch.from_numpy(rows), segments,
                           sgmv_step(segments, SlotStacks((one, two)), torch.device("cpu"),
                                     "triton"))
    for key, in_f, out_f in ((qkv, 64, 96), (down, 80, 64)):
        x = torch.randn(9, in_f, generator=g)
        base = torch.randn(9, out_f, generator=g)
        want, got = base.clone(), base.clone()
        add_lora_delta(x, want, torch_step, key)
        add_lora_delta(x, got, triton_step, key)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[[0, 4, 8]], base[[0, 4, 8]])  # rows without an adapter
