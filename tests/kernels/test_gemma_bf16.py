"""Gemma's native ops over bf16 (csrc/gemma_bf16.c, kernels/kserve_paged_kernels/cpu_native/ops_gemma.py) against
their definitions in kernels/kserve_paged_kernels/reference.py evaluated by torch in bf16.

The norms round where transformers' Gemma rounds (the residual sum to bf16; normalised and
times fp32 `1 + w`, then one rounding), so they equal eager bf16 value for value but where the
order of the fp32 sum of squares, or rsqrt's last fp32 bit, moves a result across a rounding
point: at most one bf16 step, on a small share. The GELU-and-multiply computes torch's tanh
form (tanh exactly +-1 past |u| = 8.66, as torch's vectorised tanh): one bf16 step at most
where the fp32 tanh differs in its last bit, except for gates below about -5, whose GELU is
below 1e-6 in size: torch's scalar tail (the last columns of a row, past its vector width)
takes libm's tanh, which is not yet +-1 there. tests/kernels/test_isa.py runs this file again
at avx2."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import cpu_native, fused_ops
from kserve_paged_kernels.reference import act_mul_ref, add_rms_norm_ref

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _native() -> None:
    assert cpu_native.load() is not None, "the native kernels did not build"


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 steps (units in the last place), elementwise."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _as_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype == BF16 and out.shape == ref.shape
    steps = _bf16_steps(out, ref)
    assert steps.max().item() <= 1
    assert (steps == 0).float().mean().item() >= 0.99


@pytest.mark.parametrize("rows, hidden", [(1, 640), (7, 100), (40, 960), (3, 5)])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_gemma_norm_bf16_is_eager_bf16(rows: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(BF16)
    residual = torch.randn(rows, hidden, generator=gen).to(BF16) if with_residual else None
    weight = (0.5 * torch.randn(hidden, generator=gen)).to(BF16)  # Gemma's offset weight
    ref_out, ref_sum = add_rms_norm_ref(x, residual, weight, 1e-6, gemma=True)
    res = residual.clone() if residual is not None else None
    out = cpu_native.gemma_add_rms_norm(x, res, 1.0 + weight.float(), 1e-6)
    assert out is not None, "bf16 rows with an fp32 1 + w must take the native kernel"
    _as_eager(out, ref_out)
    if res is not None:
        assert torch.equal(res, ref_sum)  # the sum rounded as torch's bf16 add rounds it


def test_gemma_norm_takes_only_an_fp32_offset_of_the_row_width() -> None:
    x = torch.randn(4, 64).to(BF16)
    assert cpu_native.gemma_add_rms_norm(x, None, torch.ones(64).to(BF16), 1e-6) is None
    assert cpu_native.gemma_add_rms_norm(x, None, torch.ones(63), 1e-6) is None
    assert cpu_native.gemma_add_rms_norm(x, torch.zeros(4, 64), torch.ones(64), 1e-6) is None
    # fp32 rows: the fp32 kernel, the same order.
    xf = torch.randn(4, 64)
    w = 1.0 + torch.randn(64)
    got = cpu_native.gemma_add_rms_norm(xf, None, w, 1e-6)
    torch.testing.assert_close(got, add_rms_norm_ref(xf, None, w - 1.0, 1e-6, gemma=True)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, q_heads, k_heads, head_dim", [(1, 4, 1, 256), (37, 3, 1, 32),
                                                              (4, 2, 2, 6)])
def test_gemma_qk_norm_bf16_is_eager_bf16_in_place(rows: int, q_heads: int, k_heads: int,
                                                   head_dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + head_dim)
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=gen) * 2).to(BF16)
    q_w, k_w = ((0.5 * torch.randn(head_dim, generator=gen)).to(BF16) for _ in range(2))
    q_end, k_end = q_heads * head_dim, (q_heads + k_heads) * head_dim
    want_q = add_rms_norm_ref(qkv[:, :q_end].reshape(-1, head_dim), None, q_w, 1e-6,
                              gemma=True)[0].reshape(rows, -1)
    want_k = add_rms_norm_ref(qkv[:, q_end:k_end].reshape(-1, head_dim), None, k_w, 1e-6,
                              gemma=True)[0].reshape(rows, -1)
    got = qkv.clone()
    assert cpu_native.gemma_qk_norm_inplace(got, q_heads, k_heads, head_dim,
                                            1.0 + q_w.float(), 1.0 + k_w.float(), 1e-6)
    _as_eager(got[:, :q_end], want_q)
    _as_eager(got[:, q_end:k_end], want_k)
    assert torch.equal(got[:, k_end:], qkv[:, k_end:])  # v untouched
    assert cpu_native.gemma_qk_norm_inplace(got, q_heads, k_heads, head_dim, q_w, k_w,
                                            1e-6) is None  # bf16 weights: not Gemma's form


@pytest.mark.parametrize("rows, inter", [(16, 2048), (9, 100), (33, 7), (70, 1152)])
def test_gelu_mul_bf16_is_eager_bf16(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(BF16)
    out = fused_ops.act_mul(gate_up, gelu=True)
    assert out is not None, "bf16 GeGLU rows must take the native kernel"
    ref = act_mul_ref(gate_up, gelu=True)
    assert out.dtype == BF16 and out.shape == ref.shape
    steps = _bf16_steps(out, ref)
    deep = gate_up[:, :inter].float() < -5  # the GELU is below 1e-6 in size there
    assert steps[~deep].max().item() <= 1
    assert (steps[~deep] == 0).float().mean().item() >= 0.999
    torch.testing.assert_close(out[deep].float(), ref[deep].float(), rtol=0, atol=1e-5)
    assert cpu_native.gelu_mul(gate_up.float()) is None  # fp32 GeGLU runs inside the GEMM
    assert cpu_native.gelu_mul(gate_up[:, 1:]) is None  # not contiguous rows


def test_gelu_mul_bf16_takes_every_bf16_gate() -> None:
    """Every bf16 gate from 1e-36 to 60 in size, both signs (up = 1: the GELU alone, rounded
    once), in one row of a multiple of 64 (torch's vectorised path throughout; the deep negative
    gates too). Not those near the subnormals (GELU ~ x / 2 below 1.2e-38): the library is
    built with -ffast-math, which may flush them to zero."""
    every = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(BF16)
    size = every.float().abs()
    gate = every[torch.isfinite(every) & (size < 60) & (size >= 1e-36)]
    gate = gate[: gate.numel() // 64 * 64]
    gate_up = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0)
    out = cpu_native.gelu_mul(gate_up)[0]
    steps = _bf16_steps(out, torch.nn.functional.gelu(gate, approximate="tanh"))
    assert steps.max().item() <= 1
    assert (steps == 0).float().mean().item() >= 0.999
