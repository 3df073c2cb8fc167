"""Weight-only quantized matmuls (kernels/kserve_paged_kernels/quant_linear.py) against the dequantized float
reference: int4 group-wise, int8 per channel; float32 activations on our native kernel
(tests/kernels/test_quant_gemm.py covers it shape by shape), bfloat16 on PyTorch's packed CPU
kernel. PyTorch picks its kernel's vector code by the CPU itself; what is asserted holds on
every CPU."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import quant_linear as ql

OUT, IN = 40, 256  # 40: not a multiple of any tile the packing might assume


def _random_groups(group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8)
    scale = torch.rand(OUT, IN // group, generator=g) * 0.02 + 0.001
    minimum = (torch.rand(OUT, IN // group, generator=g) - 0.5) * 0.2
    return codes, scale, minimum


@pytest.mark.parametrize("group", ql.INT4_GROUP_SIZES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_mm_float32_matches_the_dequantized_weight(group: int, rows: int) -> None:
    codes, scale, minimum = _random_groups(group)
    weight = ql.pack_int4(codes, scale, minimum, group, torch.float32)
    reference = ql.dequant_int4_reference(codes, scale, minimum, group)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(1))
    out = ql.int4_mm(x, weight)
    assert out.shape == (rows, OUT) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ reference.t(), atol=1e-4, rtol=1e-4)


def test_int4_codes_come_back_exactly() -> None:
    """The packing keeps every code, scale and minimum: the float32 weight it stands for is
    the reference's (to float32 rounding of `(q - 8) * s + (m + 8 s)`)."""
    codes, scale, minimum = _random_groups(32, seed=3)
    weight = ql.pack_int4(codes, scale, minimum, 32, torch.float32)
    torch.testing.assert_close(ql.dequant(weight),
                               ql.dequant_int4_reference(codes, scale, minimum, 32),
                               atol=1e-7, rtol=0)


def test_int4_mm_bfloat16_activations() -> None:
    """bf16 activations take bf16 scales and zeros: close to the reference, not exact."""
    codes, scale, minimum = _random_groups(64, seed=5)
    weight = ql.pack_int4(codes, scale, minimum, 64, torch.bfloat16)
    reference = ql.dequant_int4_reference(codes, scale, minimum, 64)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(2))
    out = ql.int4_mm(x.bfloat16(), weight)
    assert out.dtype == torch.bfloat16
    expected = x @ reference.t()
    assert float((out.float() - expected).abs().max()) < 0.02 * float(expected.abs().max())


def test_matmul_takes_any_leading_shape() -> None:
    codes, scale, minimum = _random_groups(32)
    weight = ql.pack_int4(codes, scale, minimum, 32, torch.float32)
    x = torch.randn(2, 3, IN)
    torch.testing.assert_close(ql.matmul(x, weight),
                               ql.int4_mm(x.reshape(6, IN), weight).reshape(2, 3, OUT))


def test_quantize_int4_rounds_within_half_a_step() -> None:
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(4))
    codes, scale, minimum = ql.quantize_int4(w, 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    err = (ql.dequant_int4_reference(codes, scale, minimum, 32) - w).abs()
    bound = scale.repeat_interleave(32, dim=1) / 2
    assert bool((err <= bound + 1e-6).all())
    assert float(err.max()) > 0  # it did quantize


def test_int8_per_channel_matches_its_dequantized_weight() -> None:
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(6))
    weight = ql.quantize_int8(w, torch.float32)
    deq = ql.dequant(weight)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(9, IN)
    torch.testing.assert_close(ql.matmul(x, weight), x @ deq.t(), atol=1e-4, rtol=1e-4)


def test_bad_layouts_are_refused() -> None:
    codes, scale, minimum = _random_groups(32)
    with pytest.raises(ValueError, match="group size"):
        ql.pack_int4(codes, scale, minimum, 16, torch.float32)
    with pytest.raises(ValueError, match="scales of shape"):
        ql.pack_int4(codes, scale[:, :-1], minimum, 32, torch.float32)
    with pytest.raises(ValueError, match="0..15"):
        ql.pack_int4(codes.int() + 8, scale, minimum, 32, torch.float32)
    with pytest.raises(ValueError, match="groups of"):
        ql.quantize_int4(torch.randn(4, 48), 32)
