"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache: the reference.

The cache holds one latent row per token and layer: the normalised compressed KV
(`kv_lora_rank` values) followed by the RoPE'd shared key (`qk_rope_head_dim`), `D` values in
all, instead of per-head keys and values. It lives in the contract's cache layout
`[2, num_blocks, block_size, 1, D // 2]` (metadata.py): the row's first half in the K plane,
its second half in the V plane, one "KV head". So a latent block is an ordinary block to
everything that moves blocks by id (the block pool, prefix caching, copy-on-write forks, swap
and the KV tiers), its bytes are `D` values per token and layer (the planner's and the
engine's sizing, `kv_sizing.py`), and a quantized cache (`--kv-cache-dtype`, kv_quant.py)
holds it with one scale per block for each half.

Two ways to attend, the same math (tests/kernels/test_mla_reference.py checks them equal):
- absorbed (decode): the query's no-RoPE part is multiplied into the latent space by the
  key up-projection ahead of attention, so each head attends the latent rows directly (MQA,
  one shared "head" of `D` values), and the output stays in the latent space until the
  value up-projection: `attend_latent` here.
- expanded (prefill): the latents are up-projected to per-head keys and values by the model
  (kv_b_proj) and attended as ordinary multi-head attention: `attend_expanded` here.

Torch over gathered blocks, one sequence at a time: a first version, not a fused kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kserve_paged_kernels.kv_quant import QuantKV, dequantize
from kserve_paged_kernels.metadata import AttentionMetadata


def latent_cache_shape(num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
    """The cache tensor of one layer's latents; ValueError for an odd latent width."""
    if latent_dim % 2:
        raise ValueError(f"a latent row of {latent_dim} values does not split into the cache's "
                         "K and V halves (kv_lora_rank + qk_rope_head_dim must be even)")
    return (2, num_blocks, block_size, 1, latent_dim // 2)


def store_latent(latent: torch.Tensor, kv_cache: torch.Tensor | QuantKV,
                 slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Write latent rows `[T, D]` into their slots (< 0: skipped) through the ordinary K/V
    store (quantized caches included)."""
    from kserve_paged_kernels.dispatch import store_kv

    half = latent.shape[-1] // 2
    store_kv(latent[:, None, :half], latent[:, None, half:], kv_cache, slot_mapping,
             backend=backend)


def gather_latents(kv_cache: torch.Tensor | QuantKV, block_row: torch.Tensor, length: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The first `length` latent rows `[length, D]` of one sequence (its block-table row), in
    `dtype` (a quantized cache dequantized)."""
    block_size = kv_cache.shape[2]
    blocks = block_row[: -(-length // block_size)].long()
    if isinstance(kv_cache, QuantKV):
        planes = dequantize(kv_cache, blocks, dtype)
    else:
        planes = kv_cache.index_select(1, blocks).to(dtype)
    rows = torch.cat((planes[0], planes[1]), dim=-1)  # [n_blocks, block_size, 1, D]
    return rows.reshape(-1, rows.shape[-1])[:length]


def sequences(meta: AttentionMetadata) -> Iterator[tuple[int, int, int, int]]:
    """Each sequence of the step with new tokens: (its block-table row, first new row, number
    of new rows, context length including them)."""
    starts = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len:
            yield i, starts[i], q_len, int(seq_len)


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """True where new row i (at position kv_len - q_len + i) must not see key j."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] > rows


def attend_latent(q: torch.Tensor, latents: torch.Tensor, value_dim: int,
                  scale: float) -> torch.Tensor:
    """Absorbed MLA of one sequence: q `[q_len, H, D]` (the latent-space query, then its RoPE
    part) over its latent rows `[kv_len, D]`, causal; the value is each row's first
    `value_dim` values (the compressed KV). -> `[q_len, H, value_dim]` float32."""
    q32, kv32 = q.float(), latents.float()
    scores = torch.einsum("qhd,kd->hqk", q32, kv32) * scale
    scores.masked_fill_(_causal_mask(q.shape[0], kv32.shape[0], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,kd->qhd", probs, kv32[:, :value_dim])


def attend_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Expanded MLA of one sequence: per-head q `[q_len, H, Dk]` over keys `[kv_len, H, Dk]`
    and values `[kv_len, H, Dv]` up-projected from its latents, causal.
    -> `[q_len, H, Dv]` float32."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores.masked_fill_(_causal_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())
