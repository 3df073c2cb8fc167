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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (with
    `causal` False, bidirectional: every new token sees every key of its sequence).

    Query token j of sequence i sits at position `seq_lens[i] - q_len_i + j` and sees positions
    0..that position; with a sliding `window` only the last `window` of them (positions
    `p - window + 1 .. p`, transformers' and vLLM's convention). `softcap`: scores (after
    `scale`) become `softcap * tanh(score / softcap)` before the softmax (Gemma 2).
    Returns `[num_tokens, num_heads, head_dim]` in the query's dtype. A quantized cache
    (`QuantKV`) is read as its dequantized float32 values (`code * scale`).
    """
    if isinstance(kv_cache, QuantKV):
        kv_cache = dequantize(kv_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        hidden = k_pos > q_pos if causal else torch.zeros_like(k_pos > q_pos)
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


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
