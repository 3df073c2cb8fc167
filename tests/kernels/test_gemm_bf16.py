"""The native bf16 GEMM (kernels/kserve_paged_kernels/csrc/gemm_bf16.c) and the Linear layer that uses it.

What holds on every machine type: the product of bf16 rows and a pair-packed bf16 weight is
the fp32 product of the same (bf16) values, rounded once to bf16. Per output, with
ref = sum_k x_k w_k in float64 over the bf16 values and s = sum_k |x_k w_k|: the kernel's fp32
sum is within K 2^-24 s of ref (every product is exact in fp32; only the sums round), and the
rounding to bf16 adds at most half an ulp, 2^-8 |value|. So |y - ref| <= 2^-8 |ref| +
2 K 2^-24 s. Against F.linear in bf16 (oneDNN or torch's own, its own fp32 order) the two are
then at most one bf16 ulp apart where the sums are not near a rounding boundary; the bound is
what is asserted. The shapes cover every tail of both panel widths (16 and 48 columns) and
row tiles (4, 6, 8 rows), odd K refused, blocks of 256 rows, strided rows and a bias.
`test_isa.py` runs this file again at the avx2 level.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_kernels import cpu_native


@pytest.fixture(autouse=True)
def _native_built() -> None:
    assert cpu_native.gemm_available(), "the native CPU kernels did not build"


def _bound_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
              ulps: int = 1) -> None:
    """|y - ref| <= ulps 2^-8 |ref| + 2 (K + 1) 2^-24 s (the module docstring's bound)."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (0 if bias is None else bias.double())
    s = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    tol = ulps * 2.0 ** -8 * ref.abs() + 2 * (x.shape[1] + 1) * 2.0 ** -24 * s
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


@pytest.mark.parametrize("rows", [1, 3, 5, 7, 8, 13, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (50, 34), (49, 8), (97, 160), (17, 2)])
def test_gemm_bf16_is_the_fp32_product_rounded_once(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    packed = cpu_native.pack_gemm_weight_bf16(w)
    p = cpu_native.gemm_panel()
    assert packed.shape == (-(-n // p), k // 2, p) and packed.dtype == torch.int32
    for b in (None, bias):
        y = cpu_native.gemm_bf16(x, packed, n, b)
        assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, n)
        _bound_ok(y, x, w, b)
        # F.linear in bf16 holds the same bound, so the two are within twice of it apart.
        _bound_ok(y.double() - F.linear(x, w, b).double() + (x.double() @ w.double().T + (
            0 if b is None else b.double())), x, w, b, ulps=2)


def test_gemm_bf16_reads_strided_rows_and_refuses_what_it_cannot_take() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(100, 64, generator=gen).bfloat16()
    packed = cpu_native.pack_gemm_weight_bf16(w)
    wide = torch.randn(9, 80, generator=gen).bfloat16()
    x = wide[:, 8:72]  # rows of 64 with a stride of 80
    _bound_ok(cpu_native.gemm_bf16(x, packed, 100), x, w, None)
    assert cpu_native.gemm_bf16(x.float(), packed, 100) is None  # fp32 rows
    assert cpu_native.gemm_bf16(x.t(), packed, 100) is None  # columns, not rows
    assert cpu_native.gemm_bf16(x[:, :32], packed, 100) is None  # K differs from the weight's
    assert cpu_native.gemm_bf16(x, packed, 100, torch.zeros(100)) is None  # fp32 bias
    with pytest.raises(ValueError, match="even"):
        cpu_native.pack_gemm_weight_bf16(torch.zeros(4, 7, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_bf16_linear_takes_the_native_gemm_where_chosen(rows: int) -> None:
    """A bf16 `Linear` after `pack()`: the native product where `native_bf16_linear()` chooses
    it (measured faster there, BENCHMARKS.md), and always within the bound of the product."""
    torch.manual_seed(rows)
    lin = Linear(96, 130, bias=True).to(torch.bfloat16).eval()
    x = torch.randn(rows, 96).bfloat16()
    with torch.no_grad():
        assert lin.pack()
        assert lin._bf16_native == cpu_native.native_bf16_linear()
        y = lin(x)
    _bound_ok(y, x, lin.weight.detach(), lin.bias.detach())
