"""The Triton MXFP4 linear (kernels/kserve_paged_kernels/mxfp4_triton.py), which decodes the
4-bit weight inside its K loop, against `F.linear` over the decoded weight. Without CUDA the
kernel runs in Triton's interpreter (the `triton_interpreter` fixture)."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import mxfp4
from tests.kernels.interpreted import DEVICE


@pytest.fixture(scope="module")
def mt(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.mxfp4_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (19, 33, 160)])
def test_triton_linear_matches_the_decoded_weight(mt, rows: int, n: int, k: int,
                                                  dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (n, k // 32), generator=g, dtype=torch.uint8)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    ref = torch.nn.functional.linear(x.double(), mxfp4.dequantize(blocks, scales).double(),
                                     bias.double())
    out = mt.mxfp4_linear_triton(x.to(DEVICE), blocks.to(DEVICE), scales.to(DEVICE),
                                 bias.to(DEVICE))
    assert out.dtype == dtype and out.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=2e-2)
