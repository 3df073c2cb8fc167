"""Pure-PyTorch references that define what each kernel computes.

Slow on purpose (a Python loop over sequences, fp32 math): tests compare every fast path with
these. The layout and argument meanings are the contract in docs/kernels.md.
"""

from __future__ import annotations

import torch

from kserve_paged_kernels.kv_quant import QuantKV, dequantize, store_kv_quant


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | QuantKV,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into their slots; skip slots < 0.
    A quantized cache has one definition of its store (kernels/kserve_paged_kernels/kv_quant.py: codes, scales and
    their growth), which every backend calls."""
    if isinstance(kv_cache, QuantKV):
        store_kv_quant(key, value, kv_cache, slot_mapping)
        return
    block_size = kv_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        kv_cache[0, block, offset] = key[i]
        kv_cache[1, block, offset] = value[i]


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor | QuantKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (with
    `causal` False, bidirectional: every new token sees every key of its sequence).

    Query token j of sequence i sits at position `seq_lens[i] - q_len_i + j` and sees positions
    0..that position; with a sliding `window` only the last `window` of them (positions
    `p - window + 1 .. p`, transformers' and vLLM's convention). `softcap`: scores (after
    `scale`) become `softcap * tanh(score / softcap)` before the softmax (Gemma 2).
    `sinks` `[num_heads]`: a learned logit per head that joins each row's softmax as one more
    score whose value row is zero (gpt-oss): it only adds `exp(sink)` to the denominator.
    Returns `[num_tokens, num_heads, head_dim]` in the query's dtype. A quantized cache
    (`QuantKV`) is read as its dequantized float32 values (`code * scale`).
    """
    if isinstance(kv_cache, QuantKV):
        kv_cache = dequantize(kv_cache)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k, v = _context_ref(kv_cache, block_tables[i], seq_len, query.shape[1], query.shape[2])
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(_hidden_keys_ref(q_len, seq_len, causal, window),
                                    float("-inf"))
        probs = _softmax_with_sinks_ref(scores, sinks)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def _context_ref(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values `[seq_len, num_heads, head_dim]` in float32, read from
    the blocks of its table row, each KV head repeated for the query heads of its group."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _hidden_keys_ref(q_len: int, seq_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """`[q_len, seq_len]`, True where a new token must not see a key: a later position (when
    `causal`), or one at least `window` positions back."""
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    hidden = k_pos > q_pos if causal else torch.zeros_like(k_pos > q_pos)
    if window:
        hidden |= k_pos <= q_pos - window
    return hidden


def _softmax_with_sinks_ref(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of `scores` `[num_heads, q_len, keys]` over the keys; with `sinks` each head's
    logit joins as one more column whose value row is zero, dropped after the softmax, so it
    only adds `exp(sink)` to the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def lora_sgmv_ref(x: torch.Tensor, out: torch.Tensor, a_stack: torch.Tensor,
                  b_stack: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                  seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor) -> None:
    """What `kserve_paged_kernels.lora_triton.lora_sgmv` computes, one segment at a time in float32:
    out[rows of segment s] += scales[slot] * (x[rows] @ A[slot].T) @ B[slot].T."""
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        idx = rows[start:start + length].long()
        delta = (x[idx].float() @ a_stack[slot].float().t()) @ b_stack[slot].float().t()
        out[idx] = (out[idx].float() + scales[slot].float() * delta).to(out.dtype)


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """What `kserve_paged_kernels.moe_triton.fused_moe` computes, one (token, choice) at a time in float32:
    out[t] = sum_j topk_weights[t, j] * W_down[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),
    e = topk_ids[t, j], with W_gate / W_up the first / second half of w_gate_up[e]'s rows."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = x[t].float().cpu()
        for j, e in enumerate(topk_ids[t].tolist()):
            w = w_gate_up[e].float().cpu()
            h = torch.nn.functional.silu(w[:inter] @ xt) * (w[inter:] @ xt)
            out[t] += topk_weights[t, j].float().cpu() * (w_down[e].float().cpu() @ h)
    return out.to(device=x.device, dtype=x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, *, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What `kserve_paged_kernels.fused_ops.add_rms_norm` computes, out of place: `(norm(s), s)` with
    `s = x + residual` (or `x`) rounded to x's dtype as torch's add rounds it, the mean square
    in float32, and transformers' rounding of each family: Llama casts the normalised value
    back before `weight *`; Gemma multiplies by `(1 + weight)` in float32 and casts once."""
    s = x if residual is None else x + residual
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (sf * (1.0 + weight.float())).to(x.dtype), s
    return weight * sf.to(x.dtype), s


def rope_ref(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads: int) -> torch.Tensor:
    """What `kserve_paged_kernels.fused_ops.rope_store_` does to the rows, out of place: the first `heads`
    heads of each fused qkv row (q then k; head_dim = 2 * cos.shape[1]) rotated in the
    rotate-half layout by the row's position, each product and sum rounded to the rows' dtype
    as torch's elementwise ops (and transformers' RoPE) round them; the other heads unchanged."""
    half = cos.shape[1]
    out = qkv.clone()
    rot = out[:, :heads * 2 * half].view(qkv.shape[0], heads, 2 * half)
    c = cos[positions].unsqueeze(1).to(qkv.dtype)
    s = sin[positions].unsqueeze(1).to(qkv.dtype)
    x1, x2 = rot[..., :half].clone(), rot[..., half:].clone()
    rot[..., :half] = x1 * c - x2 * s
    rot[..., half:] = x2 * c + x1 * s
    return out


def act_mul_ref(gate_up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """What `kserve_paged_kernels.fused_ops.act_mul` computes: `act(gate) * up` over a fused
    `[rows, 2 * inter]` projection (gate first), act = SiLU, or tanh-GELU with `gelu` (Gemma),
    rounded as torch rounds the two ops in the rows' dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = (torch.nn.functional.gelu(gate, approximate="tanh") if gelu
           else torch.nn.functional.silu(gate))
    return act * up
