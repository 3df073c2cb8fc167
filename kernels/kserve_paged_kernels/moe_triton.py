"""Triton fused mixture-of-experts MLP for CUDA: experts as grouped GEMMs over blocks of one
expert's (token, slot) pairs.

Layout. Expert weights are stacked, `w_gate_up [E, 2 * inter, hidden]` (gate rows first, then
up) and `w_down [E, hidden, inter]`; routing is `topk_ids / topk_weights [T, k]`. A pair p =
t * k + j is token t's j-th choice. `align_pairs` sorts the pairs by expert and pads each
expert's run to a multiple of BLOCK_M with a sentinel (T * k), so a block of BLOCK_M sorted
pairs belongs to one expert (`block_expert`, -1 past the used blocks); everything stays on the
device, and the grid is sized from an upper bound, so no host sync.

Two launches, each over every expert at once:
1. `_gate_up_kernel`: a program = one block of pairs x BLOCK_N columns of `inter`; it computes
   both the gate and the up tile of its expert for the pairs' tokens and writes
   `silu(gate) * up` into `act [T * k, inter]` (SiLU-and-mul fused into the epilogue).
2. `_down_kernel`: a program = one block of pairs x BLOCK_N columns of `hidden`; `act @ W_down[e]
   .T` times the pair's routing weight into `pair_out [T * k, hidden]`.
The per-token sum over its k choices is one `sum(dim=1)` of `pair_out` viewed `[T, k, hidden]`.
Accumulation is fp32, and `act` and `pair_out` are kept in fp32 too. `kserve_paged_kernels.reference.fused_moe_ref` is the
definition these are tested against (`tests/kernels/test_moe_triton.py`, interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kserve_paged_kernels.triton_backend import _f32_dot


@triton.jit(do_not_specialize=["num_pairs"])  # T * k changes every step
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k,
                    hidden, inter, stride_xt, stride_we, stride_wn, stride_at,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    F32_DOT: tl.constexpr):
    blk = tl.program_id(0)
    col = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert >= 0:
        pair = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        token = tl.where(m_ok, pair // top_k, 0).to(tl.int64)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_base = w_ptr + expert * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w_base + (n[None, :] + inter) * stride_wn + k[:, None], mask=w_mask,
                         other=0.0)
            if F32_DOT:
                x32 = x.to(tl.float32)
                acc_g += tl.dot(x32, wg.to(tl.float32), input_precision="ieee")
                acc_u += tl.dot(x32, wu.to(tl.float32), input_precision="ieee")
            else:
                acc_g += tl.dot(x, wg)
                acc_u += tl.dot(x, wu)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_at + n[None, :], act,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # T * k changes every step
def _down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                 hidden, inter, stride_at, stride_we, stride_wn, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 F32_DOT: tl.constexpr):
    blk = tl.program_id(0)
    col = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert >= 0:
        pair = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        row = tl.where(m_ok, pair, 0).to(tl.int64)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(act_ptr + row[:, None] * stride_at + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[None, :] * stride_wn + k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if F32_DOT:
                acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a.to(w.dtype), w)
        weight = tl.load(weights_ptr + row, mask=m_ok, other=0.0)
        acc = acc * weight[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block_m`.

    Returns `sorted_pairs [max_blocks * block_m]` (pair ids, `T * k` for padding) and
    `block_expert [max_blocks]` (the expert of each block, -1 for unused blocks), where
    `max_blocks = cdiv(T * k + E * (block_m - 1), block_m)` bounds the padded total without a
    host sync. Tensor ops of static shapes only, none that reads a value back to the host (so
    a decode step with MoE layers can be captured in a CUDA graph); the same code runs on CPU
    and CUDA."""
    flat = topk_ids.flatten().long()
    num_pairs, device = flat.numel(), flat.device
    max_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    # A scatter into a fixed-size tensor, not torch.bincount: bincount reads its range back to
    # the host on CUDA (a sync per layer, and illegal inside a CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    expert_of = flat.index_select(0, order)
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts).index_select(
        0, expert_of)
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64,
                              device=device)
    sorted_pairs.scatter_(0, padded_start.index_select(0, expert_of) + rank, order)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert.to(torch.int32)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j].

    x `[T, hidden]` (last dim contiguous), w_gate_up `[E, 2 * inter, hidden]`, w_down
    `[E, hidden, inter]`, topk_* `[T, k]`; returns `[T, hidden]` in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    num_pairs = num_tokens * top_k
    # Decode steps put few pairs on each expert: smaller row blocks waste less padding.
    block_m = 16 if num_pairs <= 64 * num_experts else 64
    sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    f32 = _f32_dot(x.dtype)
    act = torch.empty(num_pairs, inter, dtype=torch.float32, device=x.device)
    block_n, block_k = 64, 64
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, act, sorted_pairs, block_expert, num_pairs, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=f32)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.flatten().float().contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w_down, weights, pair_out, sorted_pairs, block_expert, num_pairs, hidden, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=f32)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
