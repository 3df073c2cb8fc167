"""The native fp32 GEMM (kernels/kserve_paged_kernels/csrc/gemm.c) and the Linear layer that uses it.

The GEMM is in every level's build (kernels/kserve_paged_kernels/csrc/kp_vec.h), with the level's panel width; the
shapes below cover every tail of both widths (16 and 48 columns, 6 and 8 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kserve_paged_engine.model_executor import layers
from kserve_paged_engine.model_executor.layers import Linear, SwiGLUMLP
from kserve_paged_engine.model_executor.models.gemma import GeGLUMLP
from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native import loader


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # gcc is part of the supported machine (README): a missing build must fail, not skip.
    assert cpu_native.gemm_available(), "the native CPU kernels did not build"


def test_the_panel_is_the_loaded_levels() -> None:
    """Packing follows the library: AVX-512 levels 48 columns (3 vectors of 16), AVX2 16 (2
    vectors of 8)."""
    level = loader.loaded_level()
    assert cpu_native.gemm_panel() == (48 if "avx512f" in level.needs else 16)


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 13, 64, 300, 1037])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (50, 33), (49, 7), (97, 160), (90, 40),
                                      (640, 64), (75, 24)])
def test_gemm_matches_matmul(rows: int, n: int, k: int) -> None:
    """Tail panels of every kind: one, two or three vectors of columns (AVX-512: 640 ends in
    one whole vector, 75 in a vector and a part, 50 in a part), whole and partial last vectors."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_native.pack_gemm_weight(w)
    p = cpu_native.gemm_panel()
    assert packed.shape == (-(-n // p), k, p)
    torch.testing.assert_close(cpu_native.gemm(x, packed, n), x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_native.gemm(x, packed, n, bias), x @ w.T + bias,
                               rtol=1e-5, atol=1e-4)


def test_gemm_reads_strided_rows_and_refuses_other_layouts() -> None:
    w = torch.randn(100, 64)
    packed = cpu_native.pack_gemm_weight(w)
    wide = torch.randn(10, 96)
    x = wide[:, 16:80]  # rows 96 floats apart
    torch.testing.assert_close(cpu_native.gemm(x, packed, 100), x @ w.T, rtol=1e-5, atol=1e-4)
    assert cpu_native.gemm(torch.randn(64, 10).T, packed, 100) is None  # column-major rows
    assert cpu_native.gemm(torch.randn(10, 64, dtype=torch.float64), packed, 100) is None
    assert cpu_native.gemm(torch.randn(10, 63), packed, 100) is None  # wrong K
    assert cpu_native.gemm(torch.randn(10, 64), packed[:1], 100) is None  # too few panels
    assert cpu_native.gemm(torch.randn(10, 64), packed.view(-1, 64, 8), 100) is None  # width
    with pytest.raises(ValueError):
        cpu_native.pack_gemm_weight(torch.randn(4, 4, dtype=torch.float64))


def test_gemm_of_no_rows_is_empty() -> None:
    packed = cpu_native.pack_gemm_weight(torch.randn(50, 20))
    assert cpu_native.gemm(torch.empty(0, 20), packed, 50).shape == (0, 50)


@torch.no_grad()
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(72, 130, bias=bias)
    x = torch.randn(21, 72)
    expected = F.linear(x, layer.weight, layer.bias)
    assert layer.pack()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # Any other input (3-D, another dtype) falls back to F.linear rather than failing.
    torch.testing.assert_close(layer(x.view(3, 7, 72)), expected.view(3, 7, 130),
                               rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("onednn", [False, True], ids=["no-onednn-bf16", "onednn-bf16"])
def test_bf16_linear_packs_for_the_cpu_it_is_on(onednn: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch refuses oneDNN bf16 (AVX2-only CPUs, stubbed here), a bf16 weight is widened
    to fp32 panels for the native GEMM; elsewhere oneDNN packs it. Either way the layer is
    F.linear in fp32 over the same bf16 values, rounded to bf16 once (give or take a step)."""
    if onednn and not layers.onednn_bf16():
        pytest.skip("this CPU has no oneDNN bf16 (AVX2): the widened case covers it")
    monkeypatch.setattr(layers, "onednn_bf16", lambda: onednn)
    # The native bf16 GEMM (AVX512-BF16 without AMX) has its own test (test_gemm_bf16.py).
    monkeypatch.setattr(cpu_native, "native_bf16_linear", lambda: False)
    torch.manual_seed(1)
    layer = Linear(72, 130, bias=True).to(torch.bfloat16)
    x = torch.randn(21, 72).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert layer.pack()
    assert layer._widened is not onednn and not layer._native
    assert layer._packed.dtype == (torch.bfloat16 if onednn else torch.float32)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-2)
    one = layer(x[:1])  # one row: F.linear in bf16 where widened (faster there), same values
    torch.testing.assert_close(one.float(), expected[:1], rtol=2 ** -7, atol=1e-2)


def _swiglu_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                gelu: bool = False) -> torch.Tensor:
    inter = w.shape[0] // 2
    gu = F.linear(x.double(), w.double(), None if b is None else b.double())
    gate = F.gelu(gu[:, :inter], approximate="tanh") if gelu else F.silu(gu[:, :inter])
    return (gate * gu[:, inter:]).float()


@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
@pytest.mark.parametrize(("inter", "k"), [(1536, 576), (100, 64), (48, 32), (47, 19)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("gelu", [False, True])
def test_gemm_silu_and_gelu_match_linear_then_activation(rows: int, inter: int, k: int,
                                            with_bias: bool, gelu: bool) -> None:
    """Gate/up interleaved panel by panel (each half padded to whole panels when inter is not
    a multiple of 48), SiLU-and-multiply in the GEMM: the SwiGLU half-MLP; with `gemm_gelu`
    tanh-GELU-and-multiply, the GeGLU one (Gemma)."""
    gen = torch.Generator().manual_seed(rows * 7 + inter)
    w = torch.randn(2 * inter, k, generator=gen) * 0.2
    b = torch.randn(2 * inter, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_native.pack_gate_up_weight(w)
    p = cpu_native.gemm_panel()
    assert packed.shape == (2 * -(-inter // p), k, p)
    fused_b = cpu_native.pack_gate_up_bias(b) if b is not None else None
    got = (cpu_native.gemm_gelu if gelu else cpu_native.gemm_silu)(x, packed, inter, fused_b)
    assert got is not None and got.shape == (rows, inter)
    torch.testing.assert_close(got, _swiglu_ref(x, w, b, gelu), rtol=1e-5, atol=1e-4)


def test_gemm_gelu_is_finite_and_saturates_at_large_gates() -> None:
    """Gates far out on both sides: GELU(g) * u is g * u for large positive g and 0 for large
    negative g (its e^x is clamped, so neither overflows into inf or NaN)."""
    k, inter = 8, 48
    w = torch.zeros(2 * inter, k)
    w[:inter, 0] = torch.linspace(-300.0, 300.0, inter)  # gate g = x0 * that
    w[inter:, 1] = 1.0  # up u = x1
    x = torch.tensor([[1.0, 2.0] + [0.0] * (k - 2)])
    got = cpu_native.gemm_gelu(x, cpu_native.pack_gate_up_weight(w), inter)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, _swiglu_ref(x, w, None, gelu=True), rtol=1e-5, atol=1e-4)


def test_gemm_silu_reads_strided_rows_and_refuses_other_layouts() -> None:
    w = torch.randn(200, 64)
    packed = cpu_native.pack_gate_up_weight(w)
    x = torch.randn(9, 96)[:, 16:80]
    torch.testing.assert_close(cpu_native.gemm_silu(x, packed, 100), _swiglu_ref(x, w, None),
                               rtol=1e-5, atol=1e-4)
    assert cpu_native.gemm_silu(torch.randn(9, 63), packed, 100) is None  # wrong K
    assert cpu_native.gemm_silu(torch.randn(9, 64, dtype=torch.float64), packed, 100) is None
    assert cpu_native.gemm_silu(torch.randn(9, 64), packed, 200) is None  # wrong inter
    assert cpu_native.gemm_silu(torch.randn(9, 64), packed, 100, torch.zeros(200)) is None
    with pytest.raises(ValueError):
        cpu_native.pack_gate_up_weight(torch.randn(201, 64))


@pytest.mark.parametrize("gelu", [False, True])
def test_swiglu_module_packs_once_and_matches_the_unfused_path(gelu: bool) -> None:
    """SwiGLU (Llama family) and GeGLU (Gemma) modules: once packed, one fused GEMM call."""
    torch.manual_seed(0)
    mlp = GeGLUMLP(64, 100) if gelu else SwiGLUMLP(64, 100, bias=True)
    entry = "gemm_gelu" if gelu else "gemm_silu"
    x = torch.randn(11, 64)
    with torch.no_grad():
        expected = mlp(x)  # plain F.linear path
        assert mlp.gate_up_proj.pack() and mlp.down_proj.pack()
        assert mlp.pack()
        assert mlp.gate_up_proj._packed is None  # no second packed copy of gate/up
        calls = []
        real = getattr(cpu_native, entry)
        try:
            setattr(cpu_native, entry, lambda *a, **k: calls.append(1) or real(*a, **k))
            got = mlp(x)
        finally:
            setattr(cpu_native, entry, real)
    assert calls == [1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
