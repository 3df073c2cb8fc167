"""The native paged attention over a bf16 KV cache (`kp_paged_rows_bf16`, csrc/paged_bf16.c).

What must hold at every level (tests/kernels/test_isa.py runs this file again at avx2 on a
higher machine): the kernel equals attention computed in fp32 over the same bf16 values, up to
the final rounding to bf16 and the order of fp32 sums; windows, soft caps, GQA ratios and head
dims that are not a multiple of the vector width included; prefill runs through the
transposed-key tiles (csrc/paged_bf16_tile.c: `vdpbf16ps` at the levels with AVX512-BF16, exact
widening elsewhere) included. The CPU backend sends bf16 decode rows to it, and prefill rows
where the tiles take them (head dims 64 and 128, no window or cap); other prefill rows to SDPA.
"""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_backend import paged_attention_cpu
from kserve_paged_kernels.metadata import AttentionMetadata
from kserve_paged_kernels.reference import paged_attention_ref
from kserve_paged_kernels.testing import make_case
from tests.helpers.span_cases import SPAN_CASES, span_case_id

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _native() -> None:
    assert cpu_native.load() is not None, "the native kernels did not build"


def _fp32_truth(case, **kw) -> torch.Tensor:  # noqa: ANN001 - a PagedCase
    """Attention in fp32 over the bf16 case's own values (widening is exact)."""
    q, kv, *rest = case.args()
    return paged_attention_ref(q.float(), kv.float(), *rest, **kw)


def _rows(case, **kw) -> torch.Tensor:  # noqa: ANN001 - a PagedCase
    """Every valid token through the native kernel directly."""
    q, kv, bt, seq_lens, starts, scale = case.args()
    meta = AttentionMetadata.build(bt, seq_lens, starts)
    n = int(starts[-1])
    row_lens, row_seq = meta.rows(n)
    out = torch.zeros_like(q)
    cpu_native.paged_rows(q, kv, bt, row_lens, torch.arange(n), row_seq, scale, out, **kw)
    return out


def _close_to_one_rounding(out: torch.Tensor, truth: torch.Tensor) -> None:
    """The fp32 truth rounded to bf16 once, give or take one bf16 step (sum order)."""
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), truth, atol=2e-3, rtol=2 ** -7)


CASES = [  # (seq_lens, q_lens, heads, kv_heads, head_dim, block_size)
    ([1, 17, 300, 64], [1, 1, 1, 1], 9, 3, 64, 16),     # SmolLM2's shape, decode
    ([5, 40, 129], [5, 40, 1], 8, 2, 128, 32),           # prefill rows and decode
    ([33, 200], [1, 7], 4, 1, 256, 16),                  # Gemma-3-270M's head
    ([70, 3], [2, 1], 4, 4, 72, 16),                     # head_dim not a multiple of 16
    ([45], [1], 2, 1, 20, 8),                            # nor of 8
    ([500, 1], [1, 1], 32, 1, 64, 64),                   # the largest group, one-key row
]


@pytest.mark.parametrize("case_def", CASES, ids=lambda c: f"h{c[2]}x{c[3]}-d{c[4]}-bs{c[5]}")
def test_bf16_rows_equal_fp32_attention_over_the_same_values(case_def: tuple) -> None:
    seq_lens, q_lens, heads, kv_heads, head_dim, block_size = case_def
    case = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=BF16, seed=head_dim,
                     wide_table=True)
    _close_to_one_rounding(_rows(case), _fp32_truth(case))


@pytest.mark.parametrize("case_def", SPAN_CASES, ids=span_case_id)
def test_bf16_decode_spans_equal_fp32_attention_over_the_same_values(case_def: tuple) -> None:
    seq_lens, heads, kv_heads, head_dim, block_size = case_def
    case = make_case(seq_lens, [1] * len(seq_lens), num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=BF16, seed=heads,
                     wide_table=True)
    case.query.mul_(3)  # peaked softmax rows: a wrong key, head or span rescale would show
    _close_to_one_rounding(_rows(case), _fp32_truth(case))
    # a window that starts inside a block and spans more than one span of keys
    _close_to_one_rounding(_rows(case, window=300), _fp32_truth(case, window=300))


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 5.0), (16, 2.0), (1, None)])
def test_bf16_rows_window_and_softcap(window: int | None, softcap: float | None) -> None:
    case = make_case([1, 33, 300, 64], [1, 1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype=BF16, seed=5, wide_table=True)
    case.query.mul_(4)  # large scores, so the cap bites
    out = _rows(case, window=window, softcap=softcap)
    truth = _fp32_truth(case, window=window, softcap=softcap)
    _close_to_one_rounding(out, truth)
    assert not torch.allclose(truth, _fp32_truth(case), atol=1e-2)  # the shaping mattered


def test_bf16_rows_leave_other_rows_alone_and_refuse_mixed_dtypes() -> None:
    case = make_case([40, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=64, dtype=BF16,
                     seed=1)
    q, kv, bt, seq_lens, _, scale = case.args()
    out = torch.full_like(q, 7.0)
    cpu_native.paged_rows(q, kv, bt, seq_lens[1:], torch.tensor([1]), torch.tensor([1]), scale,
                          out)
    assert bool((out[0] == 7.0).all())  # row 0 not asked for
    _close_to_one_rounding(out[1:], _fp32_truth(case)[1:])
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        cpu_native.paged_rows(q, kv, bt, seq_lens, torch.arange(2), torch.arange(2), scale,
                              out.float())


PREFILL_CASES = [  # (seq_lens, q_lens, heads, kv_heads, head_dim, block_size)
    ([200], [200], 9, 3, 64, 16),                    # SmolLM2's shape, one whole prompt
    ([300, 41, 90], [100, 1, 33], 8, 2, 128, 32),    # a chunk after a cached prefix, a decode
                                                     # row, a run of odd length (a lone last row)
    ([64, 70], [64, 70], 32, 1, 64, 16),             # the largest group, two prompts
    ([120], [120], 6, 6, 128, 64),                   # one query head per KV head
    ([40, 33], [40, 33], 5, 1, 64, 16),              # a group that the passes split unevenly
]


@pytest.mark.parametrize("case_def", PREFILL_CASES,
                         ids=lambda c: f"h{c[2]}x{c[3]}-d{c[4]}-q{sum(c[1])}")
def test_bf16_prefill_tiles_equal_fp32_attention_over_the_same_values(case_def: tuple) -> None:
    """Runs of 32 rows or more take the tiles (KT_MIN_ROWS); causality is each row's length."""
    seq_lens, q_lens, heads, kv_heads, head_dim, block_size = case_def
    case = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=BF16, seed=len(seq_lens),
                     wide_table=True)
    case.query.mul_(3)  # peaked softmax rows: a wrong key or row would show
    truth = _fp32_truth(case)
    _close_to_one_rounding(_rows(case), truth)
    causal = truth[:q_lens[0]]  # the first prompt's rows differ from one another (causality)
    assert not torch.allclose(causal[0], causal[-1], atol=1e-2)


def test_bf16_prefill_tiles_keep_their_rows_apart_and_repeat_bit_for_bit() -> None:
    """The tiles write only the rows asked for, and a second run gives the same bits."""
    case = make_case([96], [96], num_heads=9, num_kv_heads=3, head_dim=64, dtype=BF16, seed=4)
    q, kv, bt, seq_lens, starts, scale = case.args()
    meta = AttentionMetadata.build(bt, seq_lens, starts)
    row_lens, row_seq = meta.rows(96)
    pick = torch.arange(10, 90)  # one run of 80 rows, the others not asked for
    out = torch.full_like(q, 7.0)
    cpu_native.paged_rows(q, kv, bt, row_lens[pick], pick, row_seq[pick], scale, out)
    assert bool((out[:10] == 7.0).all()) and bool((out[90:] == 7.0).all())
    _close_to_one_rounding(out[10:90], _fp32_truth(case)[10:90])
    again = torch.full_like(q, 7.0)
    cpu_native.paged_rows(q, kv, bt, row_lens[pick], pick, row_seq[pick], scale, again)
    assert torch.equal(out, again)


@pytest.mark.parametrize("head_dim,window,prefill_native", [
    (64, None, True), (128, None, True), (72, None, True), (64, 16, True), (256, 16, True),
    (64, 16, False)])
def test_backend_routes_every_bf16_prefill_row_to_the_native_kernel(
        monkeypatch: pytest.MonkeyPatch, head_dim: int, window: int | None,
        prefill_native: bool) -> None:
    """The tiles take head dims 64 and 128 without a window, the row kernel the others
    (windowed, other head dims: faster than SDPA there, BENCHMARKS.md); only with
    `prefill_tiles()` False (`prefill_native` here) the prefill goes to SDPA."""
    case = make_case([50, 40, 90], [1, 40, 1], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                     block_size=16, dtype=BF16, seed=9, wide_table=True)
    calls: list[list[int]] = []
    real = cpu_native.paged_rows

    def spy(query, kv_cache, block_tables, row_lens, token_idx, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(token_idx.tolist())
        return real(query, kv_cache, block_tables, row_lens, token_idx, *args, **kw)

    monkeypatch.setattr(cpu_native, "paged_rows", spy)
    monkeypatch.setattr(cpu_native, "prefill_tiles", lambda: prefill_native)
    meta = AttentionMetadata.build(*case.args()[2:5])
    out = paged_attention_cpu(case.query, case.kv_cache, meta, case.scale, window=window)
    # every row natively, or the two decode tokens only (the prefill by SDPA)
    assert sorted(sum(calls, [])) == (list(range(42)) if prefill_native else [0, 41])
    torch.testing.assert_close(out.float(), _fp32_truth(case, window=window), atol=3e-2,
                               rtol=2e-2)
