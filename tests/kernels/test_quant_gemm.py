"""The native quantized GEMM (kernels/kserve_paged_kernels/csrc/quant_gemm.c) against the dequantized float32 weight.

int4 with a scale and a minimum per group, int8 with a scale per group (Q8_0) or per output
channel, with float32 and with bfloat16 activations. The kernel is in every level's build (the
panel is the level's: 48 columns with AVX-512, 16 with AVX2; tests/kernels/test_isa.py runs
this file on the AVX2 build too); the shapes cover panel tails of both widths, row tails of its
4-row tile and odd multiples of the group. What is asserted holds on every machine type: with
float32 rows the product equals `x @ w.T` of the dequantized weight up to float32 rounding of
the sums; with bf16 rows (all of its paths: the register path below 8 rows, the bf16-pair tiles
from 8 on, and with AVX512-BF16 the exact-code dot path from 2 rows, to 39 for 4 bits and 63 for
int8, with full and partial blocks of 8) it is within the bound `_bf16_bound` states."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels import quant_linear as ql

ROWS = [1, 3, 17, 64]
BF16_ROWS = [1, 3, 8, 17, 39, 40, 64, 300]  # 300: two blocks of 256 rows
# (out, in, group): out not a multiple of either panel, in an odd number of groups.
INT4_SHAPES = [(50, 96, 32), (97, 192, 64), (49, 384, 128), (1, 32, 32)]
INT8_SHAPES = [(50, 96, 32), (113, 160, 32), (40, 72, 72)]  # the last: one scale per channel


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # gcc is part of the supported machine (README): a missing build must fail, not skip.
    assert cpu_native.quant_available(), "the native CPU kernels did not build"


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % 2**31)


def _int4(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(n, k, group)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    minimum = (torch.rand(n, k // group, generator=g) - 0.5) * 0.2
    return codes, scale, minimum


def _int8(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(n, k, group, 8)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 0.0005
    reference = codes.float() * scale.repeat_interleave(group, dim=1)
    return codes, scale, reference


def _close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = (x.double() @ w.double().T + (0 if bias is None else bias.double())).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _bf16_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    """`out` (bf16) against Y = x w^T + bias in float64 (x, bias: the bf16 values; w: the
    dequantized weight). With u = 2^-8 (bf16's unit roundoff) and S = |x| |w|^T + |bias|:
    |out - Y| <= u (|Y| + S) + K 2^-22 S. The terms: the output rounded once to bf16 (u |Y|,
    u times the sum's error more); from 8 rows on each weight rounded to bf16 before the
    products (at most u |w| each: u S); the fp32 sums of K products (K 2^-24 S, twice for
    safety and for the dequantization's own fp32 rounding)."""
    xd, wd = x.double(), w.double()
    bd = 0 if bias is None else bias.double()
    y = xd @ wd.T + bd
    s = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    bound = 2**-8 * (y.abs() + s) + x.shape[1] * 2**-22 * s
    assert out.dtype == torch.bfloat16 and out.shape == y.shape
    excess = (out.double() - y).abs() - bound
    assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("rows", BF16_ROWS)
@pytest.mark.parametrize(("n", "k", "group"), INT4_SHAPES[:2])
def test_int4_with_bf16_rows_within_the_bf16_bound(rows: int, n: int, k: int, group: int
                                                   ) -> None:
    codes, scale, minimum = _int4(n, k, group)
    packed = cpu_native.pack_q4(codes, scale, minimum, group)
    w = ql.dequant_int4_reference(codes, scale, minimum, group)
    x = torch.randn(rows, k, generator=_gen(rows, n, 16)).bfloat16()
    bias = torch.randn(n, generator=_gen(n, 16)).bfloat16()
    _bf16_bound(cpu_native.quant_gemm(x, packed, 4, group, n), x, w, None)
    _bf16_bound(cpu_native.quant_gemm(x, packed, 4, group, n, bias), x, w, bias)


@pytest.mark.parametrize("rows", BF16_ROWS)
@pytest.mark.parametrize(("n", "k", "group"), INT8_SHAPES)
def test_int8_with_bf16_rows_within_the_bf16_bound(rows: int, n: int, k: int, group: int
                                                   ) -> None:
    codes, scale, w = _int8(n, k, group)
    packed = cpu_native.pack_q8(codes, scale, group)
    x = torch.randn(rows, k, generator=_gen(rows, n, 8, 16)).bfloat16()
    _bf16_bound(cpu_native.quant_gemm(x, packed, 8, group, n), x, w, None)
    strided = torch.randn(rows, k + 32, generator=_gen(rows, 3)).bfloat16()[:, 16:16 + k]
    _bf16_bound(cpu_native.quant_gemm(strided, packed, 8, group, n), strided, w, None)
    odd = cpu_native.pack_q8(codes[:, :45], scale[:, :1].contiguous(), 45)  # an odd group
    assert cpu_native.quant_gemm(x[:, :45].contiguous(), odd, 8, 45, n) is None


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "group"), INT4_SHAPES)
def test_int4_matches_the_dequantized_weight(rows: int, n: int, k: int, group: int) -> None:
    codes, scale, minimum = _int4(n, k, group)
    packed = cpu_native.pack_q4(codes, scale, minimum, group)
    w = ql.dequant_int4_reference(codes, scale, minimum, group)
    x = torch.randn(rows, k, generator=_gen(rows, n))
    bias = torch.randn(n, generator=_gen(n))
    _close(cpu_native.quant_gemm(x, packed, 4, group, n), x, w, None)
    _close(cpu_native.quant_gemm(x, packed, 4, group, n, bias), x, w, bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "group"), INT8_SHAPES)
def test_int8_groups_match_the_dequantized_weight(rows: int, n: int, k: int, group: int) -> None:
    codes, scale, w = _int8(n, k, group)
    packed = cpu_native.pack_q8(codes, scale, group)
    x = torch.randn(rows, k, generator=_gen(rows, n, 8))
    _close(cpu_native.quant_gemm(x, packed, 8, group, n), x, w, None)
    ids = torch.tensor([[0, n - 1], [n // 2, 1]])
    torch.testing.assert_close(cpu_native.q8_rows(packed, group, k, ids), w[ids], atol=0, rtol=0)


def test_strided_rows_are_read_and_other_layouts_refused() -> None:
    codes, scale, minimum = _int4(50, 96, 32)
    packed = cpu_native.pack_q4(codes, scale, minimum, 32)
    w = ql.dequant_int4_reference(codes, scale, minimum, 32)
    x = torch.randn(5, 128)[:, 16:112]  # rows 128 floats apart
    _close(cpu_native.quant_gemm(x, packed, 4, 32, 50), x, w, None)
    assert cpu_native.quant_gemm(x.double(), packed, 4, 32, 50) is None
    assert cpu_native.quant_gemm(torch.randn(5, 64), packed, 4, 32, 50) is None  # wrong K
    assert cpu_native.quant_gemm(x, packed, 4, 32, 200) is None  # more outputs than packed
    assert cpu_native.quant_gemm(x, packed, 8, 32, 50) is None  # the other format's size
    assert cpu_native.quant_gemm(x, packed, 4, 31, 50) is None  # K not whole groups
    with pytest.raises(ValueError, match="even"):
        cpu_native.pack_q4(codes[:, :93], scale[:, :3], minimum[:, :3], 31)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.pack_q8(codes.to(torch.int8), scale[:, :2], 32)


def test_int4_and_int8_layers_run_natively_where_chosen() -> None:
    """quant_linear packs for our kernel with float32 activations, and with bfloat16 ones where
    `native_bf16_quant()` chose it for the loaded level; elsewhere bfloat16 stays on PyTorch's
    (its scales in bf16). Group-wise int8 exists on the native kernel only."""
    codes, scale, minimum = _int4(50, 96, 32)
    assert ql.pack_int4(codes, scale, minimum, 32, torch.float32).kernel == "native"
    bf16 = ql.pack_int4(codes, scale, minimum, 32, torch.bfloat16)
    assert bf16.kernel == ("native" if cpu_native.native_bf16_quant() else "aten")
    if bf16.kernel == "native":  # PyTorch's rounds the scales to bf16: not this bound
        x16 = torch.randn(2, 3, 96).bfloat16()
        w4 = ql.dequant_int4_reference(codes, scale, minimum, 32)
        _bf16_bound(ql.matmul(x16, bf16).reshape(6, 50), x16.reshape(6, 96), w4, None)
    q8, s8, w8 = _int8(50, 96, 32)
    weight = ql.pack_int8(q8, s8, 32, torch.float32)
    assert weight.kernel == "native" and weight.scales is None
    torch.testing.assert_close(ql.dequant(weight), w8, atol=0, rtol=0)
    x = torch.randn(2, 3, 96)
    _close(ql.matmul(x, weight).reshape(6, 50), x.reshape(6, 96), w8, None)
    if cpu_native.native_bf16_quant():
        assert ql.pack_int8(q8, s8, 32, torch.bfloat16).kernel == "native"
    else:
        with pytest.raises(ValueError, match="one scale per output channel"):
            ql.pack_int8(q8, s8, 32, torch.bfloat16)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "group"), [(50, 256, 128), (97, 256, 256)])
def test_e4m3_codes_decode_exactly(rows: int, n: int, k: int, group: int) -> None:
    """Every finite e4m3 code (subnormals, both zeros, 448) appears in each weight; the kernel
    decodes it to torch's own fp8 -> float32 value (a block scale per group, or one per row)."""
    g = _gen(n, k, group, 9)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, finite.numel(), (n, k), generator=g)]
    codes[0, :finite.numel()] = finite
    e4m3 = codes.view(torch.float8_e4m3fn)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 0.0005
    packed = cpu_native.pack_e4m3(e4m3, scale, group)
    w = e4m3.float() * scale.repeat_interleave(group, dim=1)
    x = torch.randn(rows, k, generator=g)
    _close(cpu_native.quant_gemm(x, packed, ql.QUANT_E4M3, group, n), x, w, None)
    one = torch.eye(k)[:1]  # a single weight row read back: bit for bit
    assert torch.equal(cpu_native.quant_gemm(one, packed, ql.QUANT_E4M3, group, n)[0], w[:, 0])
