"""MXFP4 decode (kernels/kserve_paged_kernels/mxfp4.py) exact against two references: every
(code, exponent) pair decoded by hand from the format's definition, and transformers' own
decode of gpt-oss checkpoints (`convert_moe_packed_tensors`)."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_code_and_exponent_decodes_exactly(dtype: torch.dtype) -> None:
    exps = torch.tensor([127 - 20, 120, 126, 127, 128, 131, 127 + 20], dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)
    # One row per exponent; its 32 values are the 16 codes twice (low nibble first).
    lo, hi = codes.repeat(2)[0::2], codes.repeat(2)[1::2]
    blocks = (lo | (hi << 4)).expand(len(exps), 1, 16).contiguous()
    out = mxfp4.dequantize(blocks, exps.view(-1, 1), dtype)
    magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for r, e in enumerate(exps.tolist()):
        for col in range(32):
            code = col % 16
            value = (-1.0 if code & 8 else 1.0) * magnitude[code & 7] * 2.0 ** (e - 127)
            assert out[r, col].item() == value, (r, col)
    assert out.dtype == dtype and out.shape == (len(exps), 32)


def test_equals_transformers_decode_of_a_checkpoint_tensor() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), generator=g, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(mxfp4.dequantize(blocks, scales).transpose(1, 2), ref)


def test_mismatched_blocks_and_scales_are_refused() -> None:
    blocks = torch.zeros(4, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks.float(), torch.zeros(4, 2, dtype=torch.uint8))


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("rows", [1, 7])
def test_native_linear_matches_the_decoded_weight(rows: int) -> None:
    """The native kernel (this level's build) against `F.linear` over the decoded weight."""
    from kserve_paged_kernels.cpu_native.loader import load

    if load() is None:
        pytest.skip("native CPU kernels not built here")
    blocks, scales = _weight(40, 96, rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    ref = torch.nn.functional.linear(x.double(), mxfp4.dequantize(blocks, scales).double(),
                                     bias.double())
    out = mxfp4.linear(x, blocks, scales, bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    bf = mxfp4.linear(x.bfloat16(), blocks, scales, None)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), (ref - bias.double()).float(), atol=0.5, rtol=2e-2)
