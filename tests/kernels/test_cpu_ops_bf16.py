"""The native fused ops over bf16 (csrc/cpu_ops_bf16.c) against their definitions in
kernels/kserve_paged_kernels/reference.py evaluated by torch in bf16: residual add + RMSNorm, SiLU-and-multiply and
the KV store, RoPE. They round where eager bf16 rounds, so they agree with it value for value but for
the order of an fp32 sum (and exp's last fp32 bit): a bf16 step or two anywhere, and almost
everywhere exactly. tests/kernels/test_isa.py runs this file again at avx2."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import cpu_native, fused_ops
from kserve_paged_kernels.reference import act_mul_ref, add_rms_norm_ref, rope_ref, store_kv_ref

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _native() -> None:
    assert cpu_native.load() is not None, "the native kernels did not build"


def _as_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype == BF16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=2 ** -6)
    assert (out == ref).float().mean().item() > 0.98


@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 100), (40, 960), (3, 5)])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_add_rms_norm_bf16_is_eager_bf16(rows: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(BF16)
    residual = torch.randn(rows, hidden, generator=gen).to(BF16) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(BF16)
    ref_out, ref_sum = add_rms_norm_ref(x, residual, weight, 1e-5)
    res = residual.clone() if residual is not None else None
    out = fused_ops.add_rms_norm(x, res, weight, 1e-5)
    assert out is not None, "bf16 rows must take the native kernel"
    _as_eager(out, ref_out)
    if res is not None:
        assert torch.equal(res, ref_sum)  # the sum rounded as torch's bf16 add rounds it


def test_add_rms_norm_declines_mixed_dtypes() -> None:
    x = torch.randn(4, 64).to(BF16)
    assert fused_ops.add_rms_norm(x, None, torch.ones(64), 1e-6) is None  # fp32 weight
    assert fused_ops.add_rms_norm(x, torch.zeros(4, 64), torch.ones(64).to(BF16), 1e-6) is None


@pytest.mark.parametrize("rows, inter", [(1, 1536), (9, 100), (33, 7)])
def test_silu_mul_bf16_is_eager_bf16(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(BF16)
    out = fused_ops.act_mul(gate_up)
    assert out is not None
    _as_eager(out, act_mul_ref(gate_up))


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (37, 3, 128), (4, 2, 6)])
def test_rope_bf16_is_eager_bf16(rows: int, heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + head_dim)
    qkv = (torch.randn(rows, (heads + 1) * head_dim, generator=gen) * 2).to(BF16)
    angles = torch.rand(50, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    positions = torch.randint(0, 50, (rows,), generator=gen)
    want = rope_ref(qkv, positions, cos, sin, heads)
    got = qkv.clone()
    assert cpu_native.rope_inplace(got, positions, cos, sin, heads, head_dim)
    _as_eager(got, want)  # the last head (v) untouched, the others rotated
    assert torch.equal(got[:, heads * head_dim:], qkv[:, heads * head_dim:])
    assert cpu_native.rope_inplace(got, positions, cos.float(), sin.float(), heads,
                                   head_dim) is None  # a table of another dtype: eager


def test_store_kv_bf16_copies_rows_and_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=gen).to(BF16)
    key = torch.randn(5, 2, 8, generator=gen).to(BF16)
    value = torch.randn(5, 2, 8, generator=gen).to(BF16)
    slots = torch.tensor([3, -1, 0, 23, 9])
    want = cache.clone()
    store_kv_ref(key, value, want, slots)
    assert cpu_native.store_kv(key, value, cache, slots)
    assert torch.equal(cache, want)
    with pytest.raises(IndexError):
        cpu_native.store_kv(key, value, cache, torch.tensor([0, 1, 2, 3, 24]))
