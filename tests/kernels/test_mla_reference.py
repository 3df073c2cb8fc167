"""The paged latent cache's reference (kernels/kserve_paged_kernels/mla_reference.py): latent
rows stored and gathered back through shuffled block tables (float and int8 caches), and the
absorbed attention over the latents equal to the expanded multi-head attention it stands for."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels import mla_reference as mla
from kserve_paged_kernels.kv_quant import QuantKV
from kserve_paged_kernels.metadata import AttentionMetadata

LATENT, BLOCK, BLOCKS = 48, 4, 16


def _paged(lengths: list[int], seed: int = 0) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step prefilling sequences of `lengths` over shuffled blocks, and its latent rows."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    slots = []
    for i, n in enumerate(lengths):
        blocks = [free.pop() for _ in range(-(-n // BLOCK))]
        tables[i, :len(blocks)] = torch.tensor(blocks)
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata.build(tables, torch.tensor(lengths, dtype=torch.int32), starts,
                                   torch.tensor(slots))
    return meta, torch.randn(sum(lengths), LATENT, generator=g)


@pytest.mark.parametrize("quantized", [False, True])
def test_latents_come_back_from_their_blocks(quantized: bool) -> None:
    lengths = [7, 13, 4]
    meta, latents = _paged(lengths)
    shape = mla.latent_cache_shape(BLOCKS, BLOCK, LATENT)
    assert shape == (2, BLOCKS, BLOCK, 1, LATENT // 2)
    cache = QuantKV.zeros(shape, torch.int8) if quantized else torch.full(shape, 1e4)
    mla.store_latent(latents, cache, meta.slot_mapping, backend="cpu")
    seen = list(mla.sequences(meta))
    assert [(s, n, L) for s, _, n, L in seen] == [(0, 7, 7), (1, 13, 13), (2, 4, 4)]
    for seq, start, q_len, seq_len in seen:
        got = mla.gather_latents(cache, meta.block_tables[seq], seq_len, torch.float32)
        want = latents[start:start + q_len]
        if quantized:  # one scale per block and half: within a step of the block's range
            assert (got - want).abs().max() <= want.abs().max() / 127 + 1e-6
        else:
            assert torch.equal(got, want)


def test_odd_latent_width_is_refused() -> None:
    with pytest.raises(ValueError, match="must be even"):
        mla.latent_cache_shape(BLOCKS, BLOCK, 47)


def test_absorbed_attention_equals_the_expanded_heads() -> None:
    """q_nope . (W_UK c) == (W_UK^T q_nope) . c and sum p (W_UV c) == W_UV (sum p c): the
    latent-space attention, up-projected, is the per-head attention over expanded K/V."""
    g = torch.Generator().manual_seed(3)
    heads, rank, rope, nope, v_dim, kv_len, q_len = 3, 32, 16, 8, 12, 11, 4
    latents = torch.randn(kv_len, rank + rope, generator=g, dtype=torch.float64)
    w_uk = torch.randn(heads, nope, rank, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=g, dtype=torch.float64)
    q_nope = torch.randn(q_len, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(q_len, heads, rope, generator=g, dtype=torch.float64)
    c, k_pe = latents.split([rank, rope], dim=-1)

    k = torch.cat((torch.einsum("hnr,kr->khn", w_uk, c), k_pe[:, None].expand(-1, heads, -1)),
                  dim=-1)
    v = torch.einsum("hvr,kr->khv", w_uv, c)
    expanded = mla.attend_expanded(torch.cat((q_nope, q_pe), dim=-1), k, v, 0.3)

    q_latent = torch.cat((torch.einsum("qhn,hnr->qhr", q_nope, w_uk), q_pe), dim=-1)
    absorbed = torch.einsum("qhr,hvr->qhv", mla.attend_latent(q_latent, latents, rank, 0.3)
                            .double(), w_uv)
    torch.testing.assert_close(absorbed, expanded.double(), atol=1e-4, rtol=1e-4)
    # Causal: the first new row (position kv_len - q_len) sees no later key.
    later = latents.clone()
    later[kv_len - q_len + 1:] = 100.0
    moved = mla.attend_latent(q_latent, later, rank, 0.3)
    torch.testing.assert_close(moved[0], mla.attend_latent(q_latent, latents, rank, 0.3)[0])


def test_the_triton_store_writes_latent_rows_as_the_cpu_store(triton_interpreter) -> None:
    """The latent's half-width "head" (24 values here, 288 for DeepSeek-V3: not powers of two)
    through the Triton K/V store the CUDA backend uses (interpreted without CUDA)."""
    triton_interpreter.load("kserve_paged_kernels.triton_backend")
    meta, latents = _paged([7, 13, 4])
    shape = mla.latent_cache_shape(BLOCKS, BLOCK, LATENT)
    cpu, triton = torch.zeros(shape), torch.zeros(shape)
    mla.store_latent(latents, cpu, meta.slot_mapping, backend="cpu")
    mla.store_latent(latents, triton, meta.slot_mapping, backend="triton")
    assert torch.equal(triton, cpu) and cpu.abs().sum() > 0


@pytest.mark.parametrize("lengths", [[7, 13, 4], [1, 9]], ids=["prefill", "short"])
def test_triton_absorbed_kernel_equals_the_reference(triton_interpreter, lengths) -> None:
    """mla_triton.mla_absorbed_triton (interpreted without CUDA) against attend_latent: every
    new row of each sequence, causal, over shuffled blocks; value_dim reaching into the V
    half."""
    mt = triton_interpreter.load("kserve_paged_kernels.mla_triton")
    meta, latents = _paged(lengths, seed=5)
    cache = torch.full(mla.latent_cache_shape(BLOCKS, BLOCK, LATENT), 1e4)  # unread garbage
    mla.store_latent(latents, cache, meta.slot_mapping, backend="cpu")
    heads, value_dim = 3, 32
    q = torch.randn(sum(lengths), heads, LATENT, generator=torch.Generator().manual_seed(6))
    got = mt.mla_absorbed_triton(q, cache, meta, value_dim, 0.2)
    for seq, start, q_len, seq_len in mla.sequences(meta):
        rows = mla.gather_latents(cache, meta.block_tables[seq], seq_len, torch.float32)
        want = mla.attend_latent(q[start:start + q_len], rows, value_dim, 0.2)
        torch.testing.assert_close(got[start:start + q_len], want, atol=1e-5, rtol=1e-5)
