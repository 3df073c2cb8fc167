"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator) on
every CPU attention path against `paged_attention_ref`: the native row kernels (fp32 and bf16,
every head-dim branch: the vector passes of 64 / 128 / 256 and the portable loop), windowed and
not, prefill, chunked and decode rows; the torch path without the native kernel; the
quantized cache (dequantized, then the sink-aware kernel). This file runs again under every
lesser instruction-set level (tests/test_capped_lanes.py). The Triton kernel's sinks are
checked in tests/kernels/test_triton_backend.py (interpreter)."""

from __future__ import annotations

import pytest
import torch

import kserve_paged_kernels as kernels
from kserve_paged_kernels import cpu_backend, cpu_native
from kserve_paged_kernels.kv_quant import QuantKV, dequantize, store_kv_quant
from kserve_paged_kernels.metadata import AttentionMetadata
from kserve_paged_kernels.reference import paged_attention_ref
from kserve_paged_kernels.testing import make_case

# (name, seq_lens, q_lens, window): prefill, chunked prefill over a prefix, decode rows.
CASES = [("mixed", [9, 40, 1], [9, 7, 1], None), ("mixed_window", [9, 40, 23], [9, 7, 1], 8)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(seq_lens: list[int], q_lens: list[int], head_dim: int, dtype: torch.dtype):
    c = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                  block_size=16, dtype=dtype, seed=head_dim, wide_table=True)
    sinks = torch.linspace(-3.0, 4.0, 8)  # some far above the scores: a visible share
    return c, sinks


def _meta(c) -> AttentionMetadata:
    return AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc,
                                   backend="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_native_rows_with_sinks_match_reference(case: tuple, head_dim: int,
                                                dtype: torch.dtype) -> None:
    if cpu_native.load() is None:
        pytest.skip("native CPU kernels not built here")
    _, seq_lens, q_lens, window = case
    c, sinks = _case(seq_lens, q_lens, head_dim, dtype)
    assert cpu_native.usable(c.query, c.kv_cache)
    out = kernels.attend(c.query, c.kv_cache, _meta(c), c.scale, window=window, sinks=sinks)
    ref = paged_attention_ref(*c.args(), window=window, sinks=sinks)
    without = paged_attention_ref(*c.args(), window=window)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert (without.float() - ref.float()).abs().max() > 10 * tol  # the sinks show


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_path_with_sinks_matches_reference(case: tuple,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native kernel: the one-sequence-at-a-time path, the sink a softmax column."""
    monkeypatch.setattr(cpu_native, "usable", lambda q, kv: False)
    _, seq_lens, q_lens, window = case
    c, sinks = _case(seq_lens, q_lens, 64, torch.float32)
    out = cpu_backend.paged_attention_cpu(c.query, c.kv_cache, _meta(c), c.scale,
                                          window=window, sinks=sinks)
    ref = paged_attention_ref(*c.args(), window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_quantized_cache_with_sinks_matches_reference_on_dequantized_values() -> None:
    c, sinks = _case([9, 40, 1], [9, 7, 1], 64, torch.float32)
    kv = QuantKV.zeros(tuple(c.kv_cache.shape), torch.int8)
    slots = torch.arange(c.kv_cache.shape[1] * c.kv_cache.shape[2])
    flat = c.kv_cache.view(2, -1, *c.kv_cache.shape[3:])
    store_kv_quant(flat[0], flat[1], kv, slots)
    out = kernels.attend(c.query, kv, _meta(c), c.scale, window=8, sinks=sinks)
    ref = paged_attention_ref(c.query, dequantize(kv), *c.args()[2:], window=8, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    c, _ = _case([9], [9], 64, torch.float32)
    with pytest.raises(ValueError, match="one logit per query head"):
        kernels.attend(c.query, c.kv_cache, _meta(c), c.scale, sinks=torch.zeros(3))


def test_flash_attn_steps_of_a_sink_layer_run_on_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn's paged API takes no sinks: a sink layer's call that resolved to flash_attn
    goes to the Triton kernel with its sinks (the kernels are recorded, not launched)."""
    pytest.importorskip("triton")
    from kserve_paged_kernels import dispatch, flash_attn_backend, triton_backend

    calls: list[str] = []
    monkeypatch.setattr(dispatch, "resolve_backend", lambda *a, **kw: "flash_attn")
    monkeypatch.setattr(triton_backend, "paged_attention_triton",
                        lambda *a, **kw: calls.append("triton" if "sinks" in kw else "?"))
    monkeypatch.setattr(flash_attn_backend, "paged_attention_flash",
                        lambda *a, **kw: calls.append("flash"))
    c, sinks = _case([9], [9], 64, torch.float32)
    kernels.attend(c.query, c.kv_cache, _meta(c), c.scale, sinks=sinks)
    kernels.attend(c.query, c.kv_cache, _meta(c), c.scale)
    assert calls == ["triton", "flash"]
