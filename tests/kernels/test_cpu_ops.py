"""The native fused CPU ops (kernels/kserve_paged_kernels/csrc/cpu_ops.c) against their PyTorch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kserve_paged_engine.model_executor.layers import RMSNorm, SwiGLUMLP
from kserve_paged_engine.model_executor.rope import RotaryEmbedding, rope_parameters
from kserve_paged_kernels import cpu_native


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # gcc is part of the supported machine (README); a missing compiler must fail here, not
    # pass as skipped.
    assert cpu_native.load() is not None, "the native CPU kernels did not build"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_add_rms_norm_matches_torch_and_updates_residual(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    res = torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    expected_sum = x + res
    out = cpu_native.add_rms_norm(x, res, w, 1e-5)
    assert out is not None
    torch.testing.assert_close(res, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, _rms_ref(expected_sum, w, 1e-5), rtol=1e-5, atol=1e-5)
    plain = cpu_native.add_rms_norm(x, None, w, 1e-5)
    torch.testing.assert_close(plain, _rms_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_reads_strided_rows_and_refuses_other_layouts() -> None:
    base = torch.randn(10, 2 * 64)
    x = base[:, :64]  # row stride 128, unit stride within a row
    w = torch.ones(64)
    torch.testing.assert_close(cpu_native.add_rms_norm(x, None, w, 1e-6), _rms_ref(x, w, 1e-6),
                               rtol=1e-5, atol=1e-5)
    assert cpu_native.add_rms_norm(x.double(), None, w.double(), 1e-6) is None
    assert cpu_native.add_rms_norm(base.t()[:64], None, torch.ones(10), 1e-6) is None


def test_rmsnorm_module_native_equals_torch_path() -> None:
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, res = torch.randn(33, 96), torch.randn(33, 96)
    with torch.no_grad():
        ref_out, ref_res = norm._norm(x + res), x + res
        out, new_res = norm(x, res.clone())
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, ref_res)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("head_dim", [32, 36])
def test_qk_norm_inplace_norms_each_q_and_k_head_and_leaves_v(rows: int, head_dim: int) -> None:
    """Qwen3's per-head norm on fused rows with a row stride past the row (head_dim 36: a
    tail after whole vectors at every width)."""
    g = torch.Generator().manual_seed(rows + head_dim)
    q_heads, k_heads = 4, 2
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = (torch.randn(rows, width + 7, generator=g) * 3)[:, :width]
    qw, kw = torch.rand(head_dim, generator=g) + 0.5, torch.rand(head_dim, generator=g) + 0.5
    heads = qkv.reshape(rows, -1, head_dim).clone()
    want_q = _rms_ref(heads[:, :q_heads], qw, 1e-6)
    want_k = _rms_ref(heads[:, q_heads:q_heads + k_heads], kw, 1e-6)
    v_before = qkv[:, (q_heads + k_heads) * head_dim:].clone()
    assert cpu_native.qk_norm_inplace(qkv, q_heads, k_heads, head_dim, qw, kw, 1e-6)
    got = qkv.reshape(rows, -1, head_dim)
    torch.testing.assert_close(got[:, :q_heads], want_q)
    torch.testing.assert_close(got[:, q_heads:q_heads + k_heads], want_k)
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim:], v_before)
    assert cpu_native.qk_norm_inplace(qkv, q_heads, k_heads, head_dim, qw[:-1], kw, 1e-6) is None


@pytest.mark.parametrize("rows", [1, 5, 80])
def test_rope_inplace_matches_rotate_half(rows: int) -> None:
    class Cfg:
        max_position_embeddings = 512
        rope_theta = 10000.0

    heads, kv_heads, d = 4, 2, 32
    rot = RotaryEmbedding(d, 512, rope_parameters(Cfg()))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    pos = torch.randint(0, 512, (rows,))
    q = qkv[:, :heads * d].reshape(rows, heads, d).clone()
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(rows, kv_heads, d).clone()
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    with torch.no_grad():
        q_ref, k_ref = rot(pos, q, k)
        assert rot.rotate_fused_(pos, qkv, heads + kv_heads)
    torch.testing.assert_close(qkv[:, :heads * d].reshape(rows, heads, d), q_ref,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[:, heads * d:(heads + kv_heads) * d].reshape(rows, kv_heads, d),
                               k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched


def test_rope_rejects_positions_outside_the_table() -> None:
    cos = sin = torch.zeros(8, 4)
    x = torch.randn(2, 16)
    with pytest.raises(IndexError):
        cpu_native.rope_inplace(x, torch.tensor([0, 8]), cos, sin, 2, 8)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_silu_mul_matches_torch(rows: int) -> None:
    gu = torch.randn(rows, 2 * 100) * 4
    out = cpu_native.silu_mul(gu)
    torch.testing.assert_close(out, F.silu(gu[:, :100]) * gu[:, 100:], rtol=1e-5, atol=1e-5)
    mlp = SwiGLUMLP(16, 24)
    x = torch.randn(rows, 16)
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(x).split(24, dim=-1)
        torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(gate) * up), rtol=1e-5,
                                   atol=1e-5)


def test_store_kv_native_matches_reference_and_skips_negative_slots() -> None:
    from kserve_paged_kernels.reference import store_kv_ref

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 9 * 4 + 2 * 2 * 4, generator=gen)  # k and v are strided views, as in
    k = qkv[:, 36:44].view(6, 2, 4)                          # the model's fused projection
    v = qkv[:, 44:52].view(6, 2, 4)
    slots = torch.tensor([5, -1, 0, 17, 9, -1])
    cache = torch.zeros(2, 3, 8, 2, 4)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    assert cpu_native.store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(IndexError):
        cpu_native.store_kv(k, v, cache, torch.tensor([0, 1, 2, 3, 4, 24]))
    assert torch.equal(cache, expected)  # a bad slot writes nothing
    # Other layouts are declined, for the PyTorch path to handle.
    assert not cpu_native.store_kv(k, v, cache, slots.int())
    assert not cpu_native.store_kv(k.double(), v.double(), cache.double(), slots)


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 100, 49152])
def test_argmax_rows_matches_torch_on_ties_nan_and_infinities(cols: int) -> None:
    torch.manual_seed(cols)
    x = torch.randn(12, cols)
    x[1] = float("-inf")                      # all -inf: index 0
    x[2] = 1.0                                # all equal: the first
    x[3, cols // 2] = float("nan")            # a NaN wins
    if cols > 5:
        x[4, 1] = x[4, 3] = 1e9               # tie across lanes: the first
        x[5, 4], x[5, 2] = float("nan"), float("inf")  # NaN beats +inf
        x[6, cols - 1] = 1e9                  # the max in the tail
        x[7, 16 % cols] = x[7, 0] = 1e9       # tie in the same lane of two vectors
    got = cpu_native.argmax_rows(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1))
    strided = torch.randn(5, cols + 7)[:, 3:3 + cols]
    assert torch.equal(cpu_native.argmax_rows(strided), strided.argmax(-1))
    assert cpu_native.argmax_rows(x.double()) is None  # not fp32: the caller uses torch
