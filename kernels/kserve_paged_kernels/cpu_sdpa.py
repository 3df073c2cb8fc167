"""The CPU backend's torch paths off the native kernel: block gathers and SDPA (or scores
written out, for soft-capped and sink layers) over the items of the step's plan. The strategy
and the plan are `cpu_backend`'s (its module docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kserve_paged_kernels.cpu_plan import Plan


def context_kv(kv_cache: torch.Tensor, block_idx: torch.Tensor, num_keys: int, group: int,
               head_dim: int) -> torch.Tensor:
    """The first `num_keys` keys and values held by `block_idx` as `[2, kvh, group, num_keys,
    head_dim]`: GQA without copies, a stride-0 group dim (measured as fast as enable_gqa /
    repeat_interleave on CPU, and no extra memory)."""
    num_kv_heads = kv_cache.shape[3]
    kv = kv_cache.index_select(1, block_idx)
    kv = kv.view(2, -1, num_kv_heads, head_dim)[:, :num_keys]  # [2, num_keys, kvh, d]
    return kv.permute(0, 2, 1, 3).unsqueeze(2).expand(2, num_kv_heads, group, num_keys,
                                                      head_dim)


def attend_decode_chunks(query: torch.Tensor, kv_cache: torch.Tensor, plan: Plan,
                         scale: float, out: torch.Tensor) -> None:
    """The decode rows of `plan` into `out` off the native kernel: per chunk one block
    gather and one SDPA with the key-padding mask, a row's query heads sharing a KV head as
    SDPA's query length (`cpu_backend`'s module docstring)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    for chunk in plan.decode:
        n = chunk.token_idx.numel()
        kv = kv_cache.index_select(1, chunk.block_idx)  # [2, n*nblk, bs, kvh, d]
        kv = kv.view(2, n, chunk.padded_len, num_kv_heads, head_dim).transpose(2, 3)
        q = query.index_select(0, chunk.token_idx).view(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=chunk.mask, scale=scale)
        out.index_copy_(0, chunk.token_idx, o.reshape(n, num_heads, head_dim).to(out.dtype))


def attend_prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: Plan, scale: float,
                   out: torch.Tensor) -> None:
    """The prefill items of `plan` into `out`, one SDPA per sequence: `is_causal` when the
    query covers the whole context, else the item's bottom-right causal mask."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    for item in plan.prefill:
        q_len = item.q_end - item.q_start
        kv = context_kv(kv_cache, item.block_idx, item.seq_len, group, head_dim)
        q = query[item.q_start:item.q_end].transpose(0, 1)  # [h, q_len, d]
        q = q.reshape(num_kv_heads, group, q_len, head_dim)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=item.mask,
                                           is_causal=item.mask is None, scale=scale)
        out[item.q_start:item.q_end] = o.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def attend_windowed(query: torch.Tensor, kv_cache: torch.Tensor, plan: Plan, scale: float,
                    softcap: float | None, out: torch.Tensor, prefill_only: bool = False,
                    sinks: torch.Tensor | None = None) -> None:
    """The windowed / soft-capped items of `plan` into `out` (`cpu_backend`'s module docstring);
    `prefill_only`: skip decode rows (the row kernel did them); `sinks` `[num_heads]`: one more
    softmax column per head, its value zero."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    for item in plan.windowed:
        q_len, n = item.q_end - item.q_start, item.num_keys
        if prefill_only and q_len == 1:
            continue
        kv = context_kv(kv_cache, item.block_idx, n, group, head_dim)
        q = query[item.q_start:item.q_end].transpose(0, 1).reshape(num_kv_heads, group, q_len,
                                                                  head_dim)
        if softcap or sinks is not None:
            scores = torch.matmul(q.float(), kv[0].float().transpose(-1, -2)) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~item.mask, float("-inf"))
            if sinks is not None:  # [kvh, group, q_len, 1]
                sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, kv[1].float()).to(query.dtype)
        else:
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=item.mask, scale=scale)
        out[item.q_start:item.q_end] = o.reshape(num_heads, q_len, head_dim).transpose(0, 1)
