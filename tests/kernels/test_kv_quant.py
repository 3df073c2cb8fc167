"""A quantized KV cache (kernels/kserve_paged_kernels/kv_quant.py): the store's codes and scales, their growth as a
block fills, and the CPU backend over int8 / fp8 blocks against the reference on the same
dequantized values (the Triton kernel's cases are in test_triton_backend.py).

What holds on every machine type: `store_kv` on CPU is the native store, which writes the
PyTorch store's codes bit for bit (test_kv_quant_native.py, at every level), and the CPU
backend's reads go to the native kernel over the codes where the library loads; the native
kernels' own tests (test_kv_quant_native.py, run at avx2 too by test_isa.py) cover them."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import AttentionMetadata, attend, copy_blocks, store_kv
from kserve_paged_kernels.kv_quant import QMAX, QuantKV, dequantize, storage_dtype
from kserve_paged_kernels.reference import paged_attention_ref
from kserve_paged_kernels.testing import make_case

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2}
SUBNORMAL = {"fp8_e4m3": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}


def _bound(x: torch.Tensor, scale: torch.Tensor, fmt: str, steps: float = 0.5) -> torch.Tensor:
    """Largest |dequantized - x| one rounding (`steps` 0.5) may leave: half a step of the
    scale for int8; for fp8 half a unit in the last place of x, or of the smallest subnormal."""
    if fmt == "int8":
        return steps * scale + 1e-6
    return 2 * steps * (x.abs() * 2.0 ** -(MANTISSA[fmt] + 1) + scale * SUBNORMAL[fmt]) + 1e-6


def _quantized(case_kv: torch.Tensor, fmt: str) -> QuantKV:
    """`case_kv`'s values stored into a quantized cache of the same shape, one call."""
    kv = QuantKV.zeros(tuple(case_kv.shape), storage_dtype(fmt))
    n = case_kv.shape[1] * case_kv.shape[2]
    flat = case_kv.float().reshape(2, n, *case_kv.shape[3:])
    store_kv(flat[0], flat[1], kv, torch.arange(n))
    return kv


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_store_is_within_one_rounding_and_the_scale_is_the_block_absmax(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, 3, 32, generator=g) * torch.rand(1, 5, 1, 3, 1, generator=g) * 4
    kv = _quantized(x, fmt)
    absmax = x.abs().amax(dim=(2, 4))  # [2, blocks, heads]
    torch.testing.assert_close(kv.scales, absmax / QMAX[kv.dtype])
    scale = kv.scales[:, :, None, :, None].expand_as(x)
    assert bool(((dequantize(kv) - x).abs() <= _bound(x, scale, fmt)).all())
    # Each format's fast widening (promotion, lookup table) is torch's cast exactly.
    assert torch.equal(dequantize(kv), kv.data.float() * kv.scales[:, :, None, :, None])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_growing_block_is_requantized_to_its_new_scale(fmt: str) -> None:
    """Tokens appended one at a time, each bigger than the last: the scale follows the block's
    absmax, and each token stays within one rounding per scale it was coded in (written at
    one, requantized at each later growth: the errors add up, which is the price of one scale
    per block, docs/quantization.md)."""
    g = torch.Generator().manual_seed(1)
    kv = QuantKV.zeros((2, 3, 8, 2, 16), storage_dtype(fmt))
    rows = torch.randn(8, 2, 16, generator=g) * torch.arange(1, 9).view(8, 1, 1)
    budget = torch.zeros(2, 8, 2, 16)  # per token: the roundings it has been through
    before = torch.zeros(2, 2)
    for t in range(8):
        store_kv(rows[t:t + 1], -rows[t:t + 1], kv, torch.tensor([8 + t]))  # block 1
        seen = rows[:t + 1]
        torch.testing.assert_close(kv.scales[0, 1], seen.abs().amax(dim=(0, 2)) / QMAX[kv.dtype])
        now = kv.scales[:, 1]  # [2, heads]
        for half in range(2):
            grown = (now[half] > before[half]).view(1, 2, 1)
            step = _bound(seen, now[half].view(1, 2, 1).expand_as(seen), fmt)
            budget[half, :t] += torch.where(grown, step[:t], torch.zeros_like(step[:t]))
            budget[half, t] = step[t]
        before = now.clone()
        got = dequantize(kv)[:, 1, :t + 1]
        assert bool(((got[0] - seen).abs() <= budget[0, :t + 1] + 1e-5).all())
        assert bool(((got[1] + seen).abs() <= budget[1, :t + 1] + 1e-5).all())
    assert kv.scales[:, 0].abs().sum() == 0 and kv.scales[:, 2].abs().sum() == 0


def test_offset_zero_restarts_a_block_and_negative_slots_are_skipped() -> None:
    kv = QuantKV.zeros((2, 2, 4, 1, 8), torch.int8)
    big = torch.full((1, 1, 8), 100.0)
    store_kv(big, big, kv, torch.tensor([4]))  # block 1, offset 0: scale 100 / 127
    small = torch.full((2, 1, 8), 0.5)
    store_kv(small, small, kv, torch.tensor([-1, 4]))  # block 1 reused by a new owner
    torch.testing.assert_close(kv.scales[:, 1, 0], torch.tensor([0.5 / 127] * 2))
    torch.testing.assert_close(dequantize(kv)[0, 1, 0], small[1])
    assert kv.scales[:, 0].abs().sum() == 0


def test_bad_storage_dtype_and_name_are_refused() -> None:
    with pytest.raises(ValueError, match="int8 is this engine's own"):
        storage_dtype("fp4")
    with pytest.raises(ValueError, match="no quantized KV format"):
        QuantKV.zeros((2, 1, 1, 1, 1), torch.float16)
    assert storage_dtype("fp8") == torch.float8_e4m3fn and storage_dtype("auto") is None


# (name, seq_lens, q_lens, heads, kv_heads, head_dim, block_size, window, softcap)
CASES = [
    ("decode", [1, 17, 70, 33], [1] * 4, 8, 2, 64, 16, None, None),
    ("prefill", [5, 40], [5, 40], 4, 4, 64, 16, None, None),
    ("chunked_mixed", [50, 9, 37], [12, 1, 37], 6, 2, 32, 8, None, None),
    ("window_softcap", [30, 1, 45], [1, 1, 20], 4, 2, 64, 16, 7, 30.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_backend_reads_the_dequantized_values(case: tuple, fmt: str,
                                                  dtype: torch.dtype) -> None:
    """Bit-level agreement is not the claim: the backend dequantizes into `dtype` and runs its
    kernels there, so fp32 agrees to summation order and bf16 to bf16 rounding."""
    _, seq_lens, q_lens, heads, kv_heads, head_dim, bs, window, softcap = case
    c = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=bs, seed=len(seq_lens) + bs)
    kv = _quantized(c.kv_cache, fmt)
    query = c.query.to(dtype)
    meta = AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc, backend="cpu")
    out = attend(query, kv, meta, c.scale, window=window, softcap=softcap)
    ref = paged_attention_ref(query.float(), dequantize(kv), c.block_tables, c.seq_lens,
                              c.query_start_loc, c.scale, window=window, softcap=softcap)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    again = attend(query, kv, meta, c.scale, window=window, softcap=softcap)  # cached plan
    assert torch.equal(again, out)


def test_bidirectional_and_block_copy_carry_the_scales() -> None:
    c = make_case([20, 9], [20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                  seed=4, spare_blocks=4)
    kv = _quantized(c.kv_cache, "int8")
    meta = AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc, backend="cpu")
    out = attend(c.query, kv, meta, c.scale, causal=False)
    ref = paged_attention_ref(c.query, dequantize(kv), c.block_tables, c.seq_lens,
                              c.query_start_loc, c.scale, causal=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    src = c.block_tables[0, :2].long()
    dst = torch.tensor([b for b in range(kv.shape[1]) if b not in src.tolist()][:2])
    copy_blocks([kv], src, dst)
    assert torch.equal(kv.scales[:, dst], kv.scales[:, src])
    assert torch.equal(dequantize(kv, dst), dequantize(kv, src))
