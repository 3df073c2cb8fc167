"""Triton backend: KV store and one varlen paged-attention kernel (+ split-KV for long decode).

Attention kernel layout. A program owns one KV head and a tile of BLOCK_M rows, where a row is a
(query token, query head) pair: BLOCK_Q = BLOCK_M // group consecutive tokens of one sequence
times the `group` query heads that share the KV head. So each K/V tile loaded from the paged
cache serves every query head of its group (GQA costs no extra memory traffic), and decode
(1 token), prefill and chunked prefill / prefix hits are the same code: row r of sequence i sits
at position `seq_len - q_len + token(r)` and sees keys 0..that position (online softmax, fp32
accumulation, exp2). Keys are walked in tiles of BLOCK_N positions; every position looks its
physical block up in the block table, so BLOCK_N does not depend on the cache block size.

Programs map to sequences without a host sync: program p belongs to the largest sequence i
with `query_start_loc[i] // BLOCK_Q + i <= p` (binary search in the kernel), which gives each
sequence at least ceil(q_len / BLOCK_Q) programs; the spares return at once. The grid is
`num_tokens // BLOCK_Q + num_seqs` programs per KV head.

Split-KV (flash-decoding). When that grid is too small to fill the GPU and the contexts are
long, each program's key range is cut into `num_splits` equal parts run by separate programs;
they write unnormalised partial outputs with their running max and sum, and a second kernel
merges them. Rule (`choose_num_splits`): with P = grid programs x KV heads, split only when
P < 2 x SM count and the longest context >= 2 x SPLIT_MIN_KEYS (256 keys); then
num_splits = min(ceil(2 x SMs / P), ceil(max_seq_len / SPLIT_MIN_KEYS), 32).
`max_seq_len` defaults to `block_tables.shape[1] * block_size` (an upper bound, no sync).
The split count is a runtime argument of both kernels (not specialized), and only whether the
keys are split at all is a constexpr: every count from 2 to 32 runs the same compiled variants,
so the warm-up's one split launch covers them all and no step compiles after it.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["choose_num_splits", "paged_attention_triton", "store_kv_triton"]

SPLIT_MIN_KEYS = 256
MAX_SPLITS = 32
_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ckv, stride_cblk, stride_coff, stride_ch,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: copy its K and V rows to the slot; negative slots are skipped."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        dst = cache_ptr + blk * stride_cblk + off * stride_coff + h * stride_ch + d
        k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Scatter key/value `[num_tokens, num_kv_heads, head_dim]` into the paged cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim))


# The sequence count, the block table's row stride (its widest row this step) and the split
# count change every step: unspecialized, so a step never waits for a new variant (1 and
# multiples of 16 would be). Whether the keys are split at all is the one constexpr (SPLIT).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits"])
def _paged_attn_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_ptr, ml_ptr, kvs_ptr,
    sinks_ptr, scale_log2e, num_seqs, num_splits, head_dim, window, softcap,
    stride_qt, stride_qh, stride_ckv, stride_cblk, stride_coff, stride_ch, stride_bt,
    stride_btc, stride_ot, stride_oh, num_heads, stride_skv, stride_sblk,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, F32_DOT: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, KV_QUANT: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Which sequence: the largest i with qsl[i] // BLOCK_Q + i <= pid.
    lo = pid * 0  # tensors from the start: loop-carried types must not change (and
    hi = lo + num_seqs - 1  # num_seqs == 1 would arrive as a constexpr)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    first_tok = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # token index within the sequence
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    row_pos = tl.where(row_ok, prefix + tok, -1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this tile of rows can see: 0 (or, with a window, the first row's window start) ..
    # prefix + last token; cut into num_splits parts.
    kv_end = prefix + tl.minimum(first_tok + BLOCK_Q, q_len)
    if not CAUSAL:  # bidirectional (encoders): every row sees its sequence's whole context
        kv_end = seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(prefix + first_tok - window + 1, 0)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_begin + split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    else:
        kv_lo = kv_begin
        kv_hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + kvh * stride_ch
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        blk = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btc, mask=pos_ok, other=0).to(tl.int64)
        kv_off = blk * stride_cblk + (pos % BLOCK_SIZE) * stride_coff
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:  # int8 / fp8 codes times their (block, head) scale, in q's dtype
            s_off = blk * stride_sblk + kvh
            k_scale = tl.load(kvs_ptr + s_off, mask=pos_ok, other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if USE_SOFTCAP:
            # softcap * tanh(s * scale / softcap), tanh from exp (exact at both ends).
            t = tl.exp(2.0 * (s * scale_log2e / 1.4426950408889634) / softcap)
            s = softcap * (1.0 - 2.0 / (t + 1.0)) * 1.4426950408889634
        else:
            s = s * scale_log2e
        visible = pos_ok[None, :] & (row_pos[:, None] >= 0)
        if CAUSAL:
            visible = visible & (pos[None, :] <= row_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(k_base + stride_ckv + kv_off[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        if KV_QUANT:
            v_scale = tl.load(kvs_ptr + stride_skv + s_off, mask=pos_ok, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        if USE_SINKS:  # each head's sink joins the denominator: exp(sink), in log2 units
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            l_i = l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part: [num_tokens, num_heads, num_splits, BLOCK_D]; ml: [num_tokens, num_heads,
        # num_splits, 2] (running max in log2 units, sum), both fp32 and contiguous.
        hs = (q_rows * num_heads + head) * num_splits + split
        tl.store(part_ptr + hs[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + hs * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + hs * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])  # one variant for every split count
def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, sinks_ptr, num_heads, head_dim, stride_ot,
                         stride_oh, num_splits, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                         USE_SINKS: tl.constexpr):
    """Combine the split partials of one (token, head): rescale to the common max, sum.
    SPLITS_P2 (a power of two >= num_splits) is the same for every launch (MAX_SPLITS')."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < num_splits
    base = (tok * num_heads + head) * num_splits
    m = tl.load(ml_ptr + (base + sp) * 2, mask=sp_ok, other=float("-inf"))
    ll = tl.load(ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)
    denom = tl.sum(w * ll, axis=0)
    if USE_SINKS:
        denom += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_safe)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    acc = tl.load(part_ptr + (base + sp)[:, None] * BLOCK_D + offs_d[None, :],
                  mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    # A split that saw no key (a padded row's, all of them) never wrote its partial: select,
    # not multiply, so its uninitialised memory (NaN, inf) cannot reach the output.
    acc = tl.where((m != float("-inf"))[:, None], acc, 0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def _f32_dot(dtype: torch.dtype) -> bool:
    """fp32 inputs get exact (non-TF32) dots; the CPU interpreter also needs fp32 dots for
    bf16, whose tl.dot it computes wrongly (triton 3.9)."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV factor for a grid of `num_programs` (rule in the module docstring)."""
    target = 2 * num_sms
    if num_programs >= target or max_seq_len < 2 * SPLIT_MIN_KEYS:
        return 1
    return max(1, min(math.ceil(target / max(num_programs, 1)),
                      math.ceil(max_seq_len / SPLIT_MIN_KEYS), MAX_SPLITS))


def _tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, dtype: torch.dtype,
           max_query_len: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): small row tiles for decode-heavy batches."""
    decode_like = (max_query_len is not None and max_query_len <= 2) or num_tokens <= 2 * num_seqs
    big = head_dim > 128 or dtype == torch.float32
    # fp32 x head_dim 256 x 64 rows needs ~140 KB of shared memory: too much off Hopper.
    prefill_m = 32 if (head_dim > 128 and dtype == torch.float32) else 64
    block_m = max(16 if decode_like else prefill_m, triton.next_power_of_2(group))
    block_n = 32 if big else 64
    num_warps = 4 if block_m <= 64 else 8
    return block_m, block_n, num_warps


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
    kv_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen paged attention (contract in docs/kernels.md); never syncs with the host.

    `num_splits` forces the split-KV factor (tests); by default `choose_num_splits` decides.
    `window`: each row sees only its last `window` positions (the key loop starts at the tile's
    first window start); `softcap`: tanh capping of the scaled scores; `causal` False: each
    row sees every key of its sequence (bidirectional encoders). `kv_scales`: float32
    `[2, num_blocks, num_kv_heads]`, the scales of a quantized cache (int8 / fp8 codes,
    kernels/kserve_paged_kernels/kv_quant.py), applied to each K and V row as it is loaded.
    `sinks` `[num_heads]`: each head's attention-sink logit, `exp(sink)` added to its softmax's
    denominator (after the key loop, or in the split merge).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    quant = kv_scales is not None
    if query.dtype not in _TL_DTYPES or (kv_cache.dtype != query.dtype and not quant):
        raise ValueError(f"unsupported dtypes query={query.dtype} kv_cache={kv_cache.dtype}")
    if quant and (kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous()):
        raise ValueError("kv_scales must be contiguous float32 [2, num_blocks, num_kv_heads]")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if sinks is not None:
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    num_seqs = seq_lens.shape[0]
    out = torch.zeros_like(query)  # zeros: padding tokens past query_start_loc[-1]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = _tiles(num_tokens, num_seqs, group, head_dim, query.dtype,
                                         max_query_len)
    block_q = max(1, block_m // group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid_m = num_tokens // block_q + num_seqs
    if num_splits is None:
        if query.is_cuda:
            bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
            if window:
                bound = min(bound, window + block_q)
            num_splits = choose_num_splits(grid_m * num_kv_heads, bound,
                                           _num_sms(query.device.index or 0))
        else:
            num_splits = 1
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    if num_splits > 1:
        part = torch.empty(num_tokens, num_heads, num_splits, block_d, dtype=torch.float32,
                           device=query.device)
        ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32,
                         device=query.device)
        ml.select(-1, 0).fill_(float("-inf"))
        ml.select(-1, 1).zero_()
    else:
        part = ml = out  # unused placeholders
    _paged_attn_kernel[(grid_m, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, part, ml,
        kv_scales if quant else out, sinks if sinks is not None else out,
        scale * _LOG2E, num_seqs, num_splits, head_dim, window or 0, float(softcap or 1.0),
        query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), num_heads,
        kv_scales.stride(0) if quant else 0, kv_scales.stride(1) if quant else 0,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d, SPLIT=num_splits > 1, F32_DOT=_f32_dot(query.dtype),
        USE_WINDOW=bool(window), USE_SOFTCAP=bool(softcap), CAUSAL=causal, KV_QUANT=quant,
        USE_SINKS=sinks is not None, num_warps=num_warps)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part, ml, out, sinks if sinks is not None else out, num_heads, head_dim,
            out.stride(0), out.stride(1), num_splits,
            SPLITS_P2=triton.next_power_of_2(MAX_SPLITS), BLOCK_D=block_d,
            USE_SINKS=sinks is not None)
    return out
