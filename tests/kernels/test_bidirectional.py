"""Bidirectional (non-causal) paged attention, for encoders: the reference against dense
attention computed here by hand, and the CPU backend and Triton (interpreted without CUDA)
against the reference. Every new token sees every key of its sequence."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import AttentionMetadata, attend, paged_attention
from kserve_paged_kernels.dense_attention import dense_attention, dense_batch
from kserve_paged_kernels.reference import paged_attention_ref
from kserve_paged_kernels.testing import make_case, tolerance

# (seq_lens, q_lens): whole sequences (encoders), a one-token sequence, an idle one, and
# new tokens after a context (the contract holds there too: all keys are visible).
CASES = [([5, 33, 120], [5, 33, 120]), ([1, 17, 9], [1, 17, 9]), ([40, 9, 31], [12, 0, 31])]


def dense(case) -> torch.Tensor:
    """Each sequence's keys gathered from its blocks, softmax over all of them."""
    out = torch.zeros_like(case.query)
    bs, kvh, d = case.kv_cache.shape[2], case.kv_cache.shape[3], case.kv_cache.shape[4]
    group = case.query.shape[1] // kvh
    starts = case.query_start_loc.tolist()
    for i, n in enumerate(case.seq_lens.tolist()):
        blocks = case.block_tables[i, :-(-n // bs)].long()
        k, v = (case.kv_cache[j, blocks].reshape(-1, kvh, d)[:n].repeat_interleave(group, 1)
                for j in (0, 1))
        q = case.query[starts[i]:starts[i + 1]]
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * case.scale, dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_reference_is_dense_attention_and_differs_from_causal(seq_lens, q_lens):
    case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=32)
    ref = paged_attention_ref(*case.args(), causal=False)
    torch.testing.assert_close(ref, dense(case), atol=1e-5, rtol=1e-5)
    causal = paged_attention_ref(*case.args())
    assert not torch.allclose(ref, causal)  # the mask really is off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_cpu_backend_equals_the_reference(seq_lens, q_lens, dtype):
    case = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    want = paged_attention_ref(case.query.float(), case.kv_cache.float(), *case.args()[2:],
                               causal=False)
    got = paged_attention(*case.args(), backend="cpu", causal=False)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_window_or_softcap_with_bidirectional_is_refused():
    case = make_case([4], [4], num_heads=2, num_kv_heads=2, head_dim=16)
    meta = AttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc,
                                   backend="cpu")
    with pytest.raises(ValueError, match="bidirectional"):
        attend(case.query, case.kv_cache, meta, case.scale, window=2, causal=False)


@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_triton_equals_the_reference(triton_interpreter, seq_lens, q_lens):
    tb = triton_interpreter.load("kserve_paged_kernels.triton_backend")
    case = make_case(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=32)
    want = paged_attention_ref(*case.args(), causal=False)
    got = tb.paged_attention_triton(*case.args(), max_seq_len=case.max_seq_len,
                                    max_query_len=case.max_query_len, causal=False)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _own_rows(case, j: int) -> torch.Tensor:
    """Keys (j=0) or values (j=1) of every sequence's tokens, in token order, from its blocks."""
    bs, kvh, d = case.kv_cache.shape[2], case.kv_cache.shape[3], case.kv_cache.shape[4]
    rows = [case.kv_cache[j, case.block_tables[i, :-(-n // bs)].long()].reshape(-1, kvh, d)[:n]
            for i, n in enumerate(case.seq_lens.tolist())]
    return torch.cat(rows)


@pytest.mark.parametrize("seq_lens", [[5, 33, 120], [1, 17, 9], [64], [30, 8, 29, 7, 30, 40]])
def test_dense_attention_equals_the_paged_reference(seq_lens):
    """The encoder's path (kserve_paged_kernels.dense_attention: the step's own K/V, one padded SDPA)
    gives what the paged contract defines when every sequence is whole in the step."""
    case = make_case(seq_lens, seq_lens, num_heads=4, num_kv_heads=4, head_dim=32)
    t = case.query.shape[0]
    qkv = torch.cat([case.query.reshape(t, -1), _own_rows(case, 0).reshape(t, -1),
                     _own_rows(case, 1).reshape(t, -1)], dim=1)
    batch = dense_batch(case.query_start_loc, case.seq_lens, t)
    assert batch is not None and sum(g.num_seqs for g in batch.groups) == len(seq_lens)
    got = dense_attention(qkv, 4, 32, batch, case.scale)
    want = paged_attention_ref(*case.args(), causal=False).reshape(t, -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_batch_refuses_a_cached_context_or_padding_rows():
    case = make_case([40, 9], [12, 9], num_heads=2, num_kv_heads=2, head_dim=16)
    assert dense_batch(case.query_start_loc, case.seq_lens, 21) is None  # cached prefix
    whole = make_case([4, 3], [4, 3], num_heads=2, num_kv_heads=2, head_dim=16)
    assert dense_batch(whole.query_start_loc, whole.seq_lens, 8) is None  # a padding row
    assert dense_batch(whole.query_start_loc, whole.seq_lens, 7) is not None
