"""The native fp32 GEMM (kernels/csrc/gemm.c) and the Linear layer that uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import Linear
from kernels import cpu_native

pytestmark = pytest.mark.skipif(
    cpu_native.load() is None or not cpu_native.gemm_available(),
    reason="the native GEMM is built only with AVX-512 (Linear then packs for oneDNN)")


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (50, 33), (49, 7), (97, 160)])
def test_gemm_matches_matmul(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_native.pack_gemm_weight(w)
    assert packed.shape == (-(-n // 48), k, 48)
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
