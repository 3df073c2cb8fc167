"""Packs that are only a step toward another stay off the huge-page arena (huge_pages.py).

The arena never reuses space, so a pack made there and then replaced would hold its memory as
long as the chunk lives: a fused MLP's plain gate/up pack, an expert's pack before the stack.
"""

from __future__ import annotations

import pytest
import torch

from kserve_paged_engine.model_executor.layers import SwiGLUMLP
from kserve_paged_engine.model_executor.models import moe
from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native.huge_pages import ALIGN, arena_taken

pytestmark = pytest.mark.skipif(not cpu_native.gemm_available(),
                                reason="the native GEMM is not loaded")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_a_fused_mlp_leaves_only_its_fused_pack_in_the_arena() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 96)
    before = arena_taken()
    mlp.gate_up_proj.pack()  # as a model's pack_weights does: every Linear, then the MLP
    mlp.down_proj.pack()
    assert mlp.pack()
    assert arena_taken() - before == _nbytes(mlp._fused) + _nbytes(mlp.down_proj._packed)
    x = torch.randn(5, 64)
    with torch.no_grad():
        gate, up = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
        want = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
        torch.testing.assert_close(mlp(x), want, rtol=1e-4, atol=1e-4)


def test_experts_are_stacked_on_huge_pages_and_their_own_packs_stay_off_them() -> None:
    torch.manual_seed(0)
    weights = torch.randn(4, 40, 32)
    before = arena_taken()
    stacked = moe._stacked(cpu_native.pack_gemm_weight, weights)
    assert arena_taken() - before == _nbytes(stacked)
    assert stacked.data_ptr() % ALIGN == 0
    for e in range(4):
        assert torch.equal(stacked[e], cpu_native.pack_gemm_weight(weights[e], huge_pages=False))
