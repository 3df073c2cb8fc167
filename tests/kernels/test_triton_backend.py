"""Triton kernels against the reference.

Without CUDA the kernels run in Triton's interpreter (the `triton_interpreter` fixture,
tests/helpers/triton.py, which restores TRITON_INTERPRET after this module's tests).
The interpreted grid is deliberately small (slow interpreter); the `gpu_grid` test is the big
one, run on CUDA by bench/gpu_acceptance.py's kernel-tests stage.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from kserve_paged_kernels import paged_attention, store_kv
from kserve_paged_kernels.reference import paged_attention_ref, store_kv_ref
from kserve_paged_kernels.testing import make_case, tolerance

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("tb")  # every test runs with the kernels loadable


@pytest.fixture(scope="module")
def tb(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.triton_backend")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (name, seq_lens, q_lens, heads, kv_heads, head_dim, block_size, num_splits)
CASES = [
    ("decode", [1, 17, 300, 64, 16], [1] * 5, 9, 3, 64, 16, None),
    ("prefill", [5, 33, 120], [5, 33, 120], 8, 2, 64, 32, None),
    ("chunked_prefix", [300, 70, 2], [45, 70, 1], 4, 4, 64, 64, None),
    ("mixed_idle", [40, 9, 200, 31], [1, 0, 13, 31], 9, 3, 64, 16, None),
    ("split_decode", [300, 250, 1, 40], [1] * 4, 8, 2, 64, 16, 4),
    ("split_chunked", [200, 20], [24, 20], 4, 4, 64, 32, 3),
]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


def _run_case(tb, seq_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
              block_size: int, num_splits: int | None, dtype: torch.dtype, seed: int) -> None:
    case = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE,
                     seed=seed, wide_table=seed % 2 == 1)
    out = tb.paged_attention_triton(*case.args(), num_splits=num_splits,
                                    max_seq_len=case.max_seq_len,
                                    max_query_len=case.max_query_len)
    _check(out, paged_attention_ref(*case.args()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_matches_reference(tb, case: tuple, dtype: torch.dtype) -> None:
    _run_case(tb, *case[1:], dtype=dtype, seed=len(case[0]))


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_head_dims(tb, head_dim: int) -> None:
    _run_case(tb, [70, 3], [1, 3], 4, 2, head_dim, 16, None, torch.float16, seed=head_dim)


def test_dispatch_and_padding_tokens() -> None:
    case = make_case([50, 20], [1, 20], num_heads=8, num_kv_heads=2, head_dim=64,
                     device=DEVICE, seed=5)
    query = torch.cat([case.query, torch.randn(3, 8, 64, device=DEVICE)])  # padding tokens
    args = (query, *case.args()[1:])
    out = paged_attention(*args, backend="triton")  # no hints: must work too
    _check(out, paged_attention_ref(*args), torch.float32)
    assert out[-3:].abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_reference_and_skips_negative(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, 5, 16, 3, 64, generator=gen).to(dtype)
    slots = torch.tensor([3, -1, 40, 79, -5, 16], dtype=torch.int64)
    # Non-contiguous key/value: slices of a fused qkv-like buffer.
    fused = torch.randn(len(slots), 2, 3, 64, generator=gen).to(dtype)
    key, value = fused[:, 0], fused[:, 1]
    expected = base.clone()
    store_kv_ref(key, value, expected, slots)
    cache = base.to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE), backend="triton")
    assert torch.equal(cache.cpu(), expected)


def test_split_rule(tb) -> None:
    rule = tb.choose_num_splits
    assert rule(num_programs=1000, max_seq_len=16384, num_sms=132) == 1  # grid already full
    assert rule(num_programs=8, max_seq_len=300, num_sms=132) == 1  # context too short
    assert rule(num_programs=8, max_seq_len=16384, num_sms=132) == 32  # 1 seq x 8 kv heads
    assert rule(num_programs=8 * 16, max_seq_len=4096, num_sms=132) == 3
    assert rule(num_programs=8, max_seq_len=1024, num_sms=132) == 4  # capped by length


@pytest.mark.gpu_grid
@pytest.mark.skipif(not HAS_CUDA, reason="the large grid needs CUDA (bench/gpu_acceptance.py)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3), (32, 8), (16, 1)],
                         ids=lambda h: f"{h[0]}x{h[1]}")
def test_gpu_grid(tb, dtype: torch.dtype, block_size: int, heads: tuple[int, int]) -> None:
    """45 configurations x (auto, forced 4-way) splits; head_dim and batch kind rotate so every
    head_dim meets every batch kind without a full product (compile time)."""
    key = DTYPES.index(dtype) * 100 + block_size + heads[0] * 7 + heads[1]
    rng = random.Random(key)
    head_dim = [64, 80, 96, 128, 256][key % 5]
    n = rng.randint(1, 12)
    seq_lens = [rng.randint(1, 2000) for _ in range(n)]
    kind = ["decode", "prefill", "chunked", "mixed"][key % 4]
    q_lens = {"decode": [1] * n, "prefill": seq_lens,
              "chunked": [rng.randint(1, s) for s in seq_lens],
              "mixed": [rng.choice([0, 1, s, rng.randint(1, s)]) for s in seq_lens]}[kind]
    for splits in (None, 4):
        _run_case(tb, seq_lens, q_lens, heads[0], heads[1], head_dim, block_size, splits, dtype,
                  seed=key)
    # The cpu backend (its SDPA path) on CUDA, same inputs.
    case = make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE,
                     seed=key)
    _check(paged_attention(*case.args(), backend="cpu"), paged_attention_ref(*case.args()),
           dtype)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# (name, seq_lens, q_lens, window, softcap, num_splits): Gemma's sliding-window / capped layers.
WINDOW_CASES = [
    ("decode_window", [1, 17, 300, 64], [1] * 4, 7, None, None),
    ("prefill_window", [5, 33, 120], [5, 33, 120], 32, None, None),
    ("chunked_window_cap", [300, 70, 2], [45, 70, 1], 16, 2.0, None),
    ("softcap_only", [40, 9, 200], [1, 9, 13], None, 5.0, None),
    ("split_window", [300, 250, 1], [1] * 3, 100, None, 3),
    # windows ending on / starting at block boundaries, capped
    ("block_edge_window_cap", [64, 48, 17], [1, 16, 1], 16, 3.0, None),
    # a window longer than every context: plain causal attention
    ("window_past_context", [40, 7], [40, 1], 500, None, None),
]


# bf16 rather than fp16: the dtype Gemma checkpoints are served in (fp16 overflows them).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_window_and_softcap_match_reference(tb, case: tuple, dtype: torch.dtype) -> None:
    _, seq_lens, q_lens, window, softcap, splits = case
    c = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=dtype, device=DEVICE, seed=len(seq_lens), wide_table=True)
    c.query.mul_(4)  # large scores, so the cap bites
    out = tb.paged_attention_triton(*c.args(), num_splits=splits, max_seq_len=c.max_seq_len,
                                    max_query_len=c.max_query_len, window=window,
                                    softcap=softcap)
    _check(out, paged_attention_ref(*c.args(), window=window, softcap=softcap), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,splits", [(None, None), (8, None), (None, 3)],
                         ids=["plain", "window", "split"])
def test_sinks_match_reference(tb, window: int | None, splits: int | None,
                               dtype: torch.dtype) -> None:
    """Attention sinks (gpt-oss): each head's exp(sink) in its denominator, after the key loop
    or in the split merge."""
    c = make_case([9, 40, 1], [9, 7, 1], num_heads=8, num_kv_heads=2, head_dim=64,
                  block_size=16, dtype=dtype, device=DEVICE, seed=5)
    sinks = torch.linspace(-3.0, 4.0, 8, device=DEVICE)
    out = tb.paged_attention_triton(*c.args(), num_splits=splits, max_seq_len=c.max_seq_len,
                                    max_query_len=c.max_query_len, window=window, sinks=sinks)
    _check(out, paged_attention_ref(*c.args(), window=window, sinks=sinks), dtype)


# Quantized KV (kernels/kserve_paged_kernels/kv_quant.py): (name, seq_lens, q_lens, heads, kv_heads, block_size,
# window, softcap, num_splits); head_dim 64.
QUANT_CASES = [
    ("decode_split", [1, 17, 300], [1] * 3, 8, 2, 16, None, None, 3),
    ("chunked_window_cap", [40, 9], [12, 9], 4, 2, 8, 7, 30.0, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
def test_quantized_kv_matches_reference_on_dequantized_values(tb, case: tuple, fmt: str,
                                                              dtype: torch.dtype) -> None:
    """int8 / fp8 codes times their (block, head) scale as the kernel loads them, against the
    reference over the dequantized float32 cache: fp32 to summation order, bf16 to bf16
    rounding of the dequantized K/V (the kernel rounds them to the query's dtype)."""
    from kserve_paged_kernels.kv_quant import QuantKV, dequantize, storage_dtype

    _, seq_lens, q_lens, heads, kv_heads, bs, window, softcap, splits = case
    c = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=64,
                  block_size=bs, seed=bs + heads)
    kv = QuantKV.zeros(tuple(c.kv_cache.shape), storage_dtype(fmt))
    n = c.kv_cache.shape[1] * bs
    flat = c.kv_cache.reshape(2, n, kv_heads, 64)
    store_kv(flat[0], flat[1], kv, torch.arange(n))
    ref = paged_attention_ref(c.query, dequantize(kv), *c.args()[2:], window=window,
                              softcap=softcap)
    kv = QuantKV(kv.data.to(DEVICE), kv.scales.to(DEVICE))
    tables, lens, qsl = (t.to(DEVICE) for t in c.args()[2:5])
    out = tb.paged_attention_triton(c.query.to(DEVICE, dtype), kv.data, tables, lens, qsl,
                                    c.scale, num_splits=splits, window=window, softcap=softcap,
                                    kv_scales=kv.scales)
    _check(out, ref, dtype)
