"""The CUDA store of a quantized KV cache (kernels/kserve_paged_kernels/kv_quant_triton.py) against the PyTorch
store (kernels/kserve_paged_kernels/kv_quant.py), in Triton's interpreter without CUDA (`triton_interpreter`): the
same codes and scales bit for bit, for int8 and both fp8 formats: blocks filled over several
calls (their scales grow and their codes are requantized), blocks restarted at their first
slot, a skipped slot, and every code and midpoint between codes at scale 1 (round to nearest
even). The sm_90 build is tests/kernels/test_triton_compile.py's."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels.kv_quant import QMAX, QuantKV, storage_dtype, store_kv_quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module")
def kqt(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.kv_quant_triton")


def _same(a: QuantKV, b: QuantKV) -> bool:
    return torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu()) and \
        torch.equal(a.scales.cpu(), b.scales.cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_store_writes_the_pytorch_stores_codes(kqt, fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    shape, dtype = (2, 8, 4, 2, 12), storage_dtype(fmt)
    ref, tri = QuantKV.zeros(shape, dtype), QuantKV.zeros(shape, dtype, DEVICE)
    for step in range(3):  # runs of 7 rows from position 3 * step: partly filled blocks
        k = torch.randn(7, 2, 12, generator=g) * (1 + step) * torch.rand(7, 2, 1, generator=g) ** 3
        v = torch.randn(7, 2, 12, generator=g) * torch.randn(7, 2, 1, generator=g).exp()
        slots = torch.arange(step * 3, step * 3 + 7)
        slots[4] = -1
        if step == 2:
            k, v = k.bfloat16(), v.bfloat16()
        store_kv_quant(k, v, ref, slots)
        kqt.store_kv_quant_triton(k.to(DEVICE), v.to(DEVICE), tri, slots.to(DEVICE))
        assert _same(ref, tri), step


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_store_rounds_every_code_and_midpoint_as_torch(kqt, fmt: str) -> None:
    dtype = storage_dtype(fmt)
    codes = (torch.arange(-127, 128).to(torch.int8) if dtype == torch.int8
             else torch.arange(256, dtype=torch.uint8).view(dtype))
    values = codes.float()
    values = values[values.isfinite() & (values.abs() <= QMAX[dtype])].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2])
    n = -(-x.numel() // 15)
    rows = torch.zeros(n * 15)
    rows[:x.numel()] = x
    rows = torch.cat([torch.full((n, 1), QMAX[dtype]), rows.view(n, 15)], 1).view(n, 1, 16)
    ref = QuantKV.zeros((2, n, 1, 1, 16), dtype)
    tri = QuantKV.zeros((2, n, 1, 1, 16), dtype, DEVICE)
    store_kv_quant(rows, rows, ref, torch.arange(n))
    kqt.store_kv_quant_triton(rows.to(DEVICE), rows.to(DEVICE), tri, torch.arange(n).to(DEVICE))
    assert bool((tri.scales == 1).all())
    assert _same(ref, tri)
