"""Efficient pure-PyTorch backend: batched block gathers + `scaled_dot_product_attention`.

This is the serving path on CPU (and a correctness fallback on CUDA). Strategy, decided per call
from the sequence metadata (read once on the host):

* on CPU in fp32 or bf16 the decode rows go to the native C kernel (`cpu_native.paged_rows`;
  in bf16 `kp_paged_rows_bf16`, fp32 softmax and sums), which reads K/V straight from the
  paged cache. Prefill rows go there too: its transposed-key tiles (every level's build, fp32
  and bf16) make it faster than SDPA (a prefill token at position p is a row that sees p + 1
  keys, which is the causal mask). The bf16 tiles take head dims 64 and 128 and layers
  without window or cap; the row kernel the other bf16 prefill rows. Without them (`cpu_native.
  prefill_tiles()` False) the kernel would walk one query row at a time, several times slower
  than SDPA for prefill, so prefill sequences would take the torch path (BENCHMARKS.md,
  "Attention on AVX2" and "One source for every level"). Otherwise (no C compiler, other
  dtypes, CUDA):
* decode rows (q_len == 1) are sorted by context length and cut into chunks whose padded size
  (rows x longest context in the chunk) stays under a token budget. Each chunk is one block
  gather (`index_select` of whole blocks) and one SDPA call with a key-padding mask. GQA costs
  nothing here: the query of a row is viewed as `[num_kv_heads, group, head_dim]`, i.e. the
  `group` query heads sharing a KV head play the role of SDPA's query length. Small chunks keep
  the gathered K/V in cache and reuse allocator memory (a single 200 MB gather per layer is
  several times slower on CPU: page faults and DRAM round trips).
* rows with q_len > 1 (prefill, chunked prefill, prefix hits) go one sequence at a time (there
  are few per step): gather the context, then SDPA with `is_causal` when the query covers the
  whole context, or an explicit bottom-right causal mask when there is a cached prefix.

* a sliding-window or soft-capped layer (Gemma 2/3) takes the native row kernel too where it
  serves (fp32 on CPU): each row starts at its window's first key, so blocks that have left
  the window are never read, and the kernel caps scores with tanh before its online softmax.
  Otherwise it goes one sequence at a time over only the blocks its window reaches, with an
  explicit causal-and-window mask: SDPA when there is no softcap, else scores, tanh cap and
  softmax written out.

* a layer with attention sinks (gpt-oss) takes the native row kernel, which adds each head's
  `exp(sink)` to its softmax's denominator (every level's build, fp32 and bf16; the
  transposed-key tiles are skipped for such layers); without it, the one-sequence-at-a-time
  path above with the scores written out and the sink as one more column of the softmax.

The plan (sorting, chunking, index tensors, masks) depends only on the metadata, which is the
same for every layer of a step, so the first layer builds it and keeps it on the step's
`AttentionMetadata` (`plan`, one entry per window size); the other layers reuse it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kserve_paged_kernels import cpu_native, cpu_sdpa, settings
from kserve_paged_kernels.cpu_plan import DecodeChunk, Plan, PrefillItem, WindowItem
from kserve_paged_kernels.metadata import AttentionMetadata

__all__ = ["bidirectional_attention_cpu", "paged_attention_cpu", "store_kv_cpu"]



def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter key/value rows into their slots with one indexed copy each; slots < 0 skipped.
    On CPU in fp32 one native pass does it (`cpu_native.store_kv`)."""
    if kv_cache.device.type == "cpu" and cpu_native.store_kv(key, value, kv_cache, slot_mapping):
        return
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    if bool((slots < 0).any()):  # a host sync on CUDA; the Triton store avoids it
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    key = key.to(kv_cache.dtype)
    value = value.to(kv_cache.dtype)
    if kv_cache.is_contiguous():
        flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)
    else:
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[0].index_put_((blocks, offsets), key)
        kv_cache[1].index_put_((blocks, offsets), value)


def _build_window_plan(seq_lens: list[int], starts: list[int], block_tables: torch.Tensor,
                       block_size: int, device: torch.device, window: int | None) -> Plan:
    """Per sequence: the blocks from the first key its first new token's window reaches to
    the end of its context, and the mask over them."""
    plan = Plan(num_valid_tokens=starts[-1] if starts else 0)
    for i, seq_len in enumerate(seq_lens):
        q_len = starts[i + 1] - starts[i]
        if q_len <= 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {i}: q_len {q_len} > seq_len {seq_len}")
        first_pos = seq_len - q_len
        first_block = max(0, first_pos - window + 1) // block_size if window else 0
        first_key = first_block * block_size
        nblk = -(-seq_len // block_size)
        q_pos = torch.arange(first_pos, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(first_key, seq_len, device=device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        plan.windowed.append(WindowItem(starts[i], starts[i + 1], first_key, seq_len - first_key,
                                        block_tables[i, first_block:nblk].long(), mask))
    return plan


def _build_plan(seq_lens: list[int], starts: list[int], block_tables: torch.Tensor,
                block_size: int, device: torch.device, budget: int) -> Plan:
    """Turn host-side metadata into gather indices and masks (see module docstring)."""
    plan = Plan(num_valid_tokens=starts[-1] if starts else 0)
    decode_rows: list[int] = []
    for i, seq_len in enumerate(seq_lens):
        q_len = starts[i + 1] - starts[i]
        if q_len <= 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {i}: q_len {q_len} > seq_len {seq_len}")
        if q_len == 1:
            decode_rows.append(i)
            continue
        nblk = -(-seq_len // block_size)
        mask = None
        if q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
            mask = torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos
        plan.prefill.append(PrefillItem(starts[i], starts[i + 1], seq_len,
                                        block_tables[i, :nblk].long(), mask))
    if not decode_rows:
        return plan
    decode_rows.sort(key=lambda r: seq_lens[r], reverse=True)
    rows_all = torch.tensor(decode_rows, device=device, dtype=torch.long)
    lens_all = torch.tensor([seq_lens[r] for r in decode_rows], device=device)
    tok_all = torch.tensor([starts[r] for r in decode_rows], device=device, dtype=torch.long)
    plan.decode_rows = (tok_all, lens_all.int(), rows_all)
    pos = 0
    while pos < len(decode_rows):
        nblk = -(-seq_lens[decode_rows[pos]] // block_size)
        padded = nblk * block_size
        n = max(1, min(len(decode_rows) - pos, budget // padded))
        rows = rows_all[pos:pos + n]
        lens = lens_all[pos:pos + n]
        block_idx = block_tables.index_select(0, rows)[:, :nblk].long().reshape(-1)
        mask = None
        if seq_lens[decode_rows[pos + n - 1]] != padded:
            mask = (torch.arange(padded, device=device).unsqueeze(0) < lens.unsqueeze(1))
            mask = mask.view(n, 1, 1, padded)
        plan.decode.append(DecodeChunk(tok_all[pos:pos + n], block_idx, padded, mask))
        pos += n
    return plan


def _plan_for(meta: AttentionMetadata, block_size: int, budget: int | None,
              window: int | None = None, capped: bool = False) -> Plan:
    """The step's plan, built by the first layer that asks and kept on the metadata (one per
    window size: Gemma's sliding and global layers share a step). `budget` None is the
    setting's, read only when a plan is built."""
    key = (block_size, budget, window, capped)
    if meta.plan is None:
        meta.plan = {}
    if key in meta.plan:
        return meta.plan[key]
    # Padded tokens (rows x context) per decode chunk (settings.TORCH_DECODE_BUDGET): big
    # enough to amortise per-op overhead, small enough for the gathered K/V to stay in L2/L3
    # between the gather and the attention (tuned on 2 CPU cores, head_dim 64, 3 KV heads).
    chunk_budget = budget or settings.torch_decode_budget()
    # One host transfer for both vectors (one sync on CUDA).
    n = meta.seq_lens.numel()
    host = torch.cat([meta.seq_lens.flatten().long(), meta.query_start_loc.flatten().long()]).tolist()
    if window is not None or capped:
        plan = _build_window_plan(host[:n], host[n:], meta.block_tables, block_size,
                                  meta.block_tables.device, window)
    else:
        plan = _build_plan(host[:n], host[n:], meta.block_tables, block_size,
                           meta.block_tables.device, chunk_budget)
    meta.plan[key] = plan
    return plan


def _prefill_native(query: torch.Tensor, shaped: bool) -> bool:
    """Whether prefill rows go to the native kernel too: wherever it is loaded, fp32 and bf16,
    windowed, capped or not. Its transposed-key tiles take the runs they can (bf16: head dims
    64 and 128 without window or cap); its row kernel the others, in bf16 as fast as the tiles
    or 2-16x faster than SDPA with its explicit masks (BENCHMARKS.md, "bf16 prefill rows of
    every layer on the native kernel"). `query` and `shaped` stay in the signature for tests
    that route by them."""
    return cpu_native.prefill_tiles()


def paged_attention_cpu(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, *, decode_token_budget: int | None = None,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen paged attention (contract in docs/kernels.md) with batched gathers + SDPA, or
    the native row kernel on CPU. The plan is derived from `meta` once per step (per window).
    `window` / `softcap`: a sliding-window or soft-capped layer; `sinks`: a layer with
    attention sinks (see the module docstring)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty_like(query)
    if query.dtype != kv_cache.dtype:
        query = query.to(kv_cache.dtype)
    native = cpu_native.usable(query, kv_cache)
    # A windowed / soft-capped layer, or one with sinks: the shaped path off the native kernel.
    shaped = window is not None or bool(softcap) or sinks is not None
    plan = _plan_for(meta, block_size, decode_token_budget)
    if plan.num_valid_tokens < num_tokens:
        out[plan.num_valid_tokens:].zero_()
    if native and (not plan.prefill or _prefill_native(query, shaped)):
        if plan.num_valid_tokens:
            # The runner's rows: every valid token, in order (padding rows come last).
            row_lens, row_seq_idx = meta.rows(plan.num_valid_tokens)
            if plan.valid_rows is None:
                plan.valid_rows = torch.arange(plan.num_valid_tokens)
            _native_rows(query, kv_cache, meta.block_tables, row_lens, plan.valid_rows,
                         row_seq_idx, scale, out, window, softcap, sinks)
        return out
    if native and plan.decode_rows is not None:  # prefill, where SDPA is faster, below
        tok, lens, seq = plan.decode_rows
        _native_rows(query, kv_cache, meta.block_tables, lens, tok, seq, scale, out, window,
                     softcap, sinks)
    if shaped:
        windowed = _plan_for(meta, block_size, decode_token_budget, window,
                             bool(softcap) or sinks is not None)
        cpu_sdpa.attend_windowed(query, kv_cache, windowed, scale, softcap, out,
                                 prefill_only=native, sinks=sinks)
        return out
    if not native:
        cpu_sdpa.attend_decode_chunks(query, kv_cache, plan, scale, out)
    cpu_sdpa.attend_prefill(query, kv_cache, plan, scale, out)
    return out


def _native_rows(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor, rows: torch.Tensor, seq_idx: torch.Tensor, scale: float,
                 out: torch.Tensor, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> None:
    """The native row kernel over `rows` (token indices; `lens` their context lengths,
    `seq_idx` their sequences) into `out`; only a sink layer's calls name `sinks`."""
    sink_arg = {} if sinks is None else {"sinks": sinks}
    cpu_native.paged_rows(query, kv_cache, block_tables, lens, rows, seq_idx, scale, out,
                          window=window, softcap=softcap, **sink_arg)


def bidirectional_attention_cpu(query: torch.Tensor, kv_cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Non-causal varlen paged attention (encoders): each sequence's new tokens over every
    key of its context, one SDPA per sequence with no mask, from the step's plan (its prefill
    items, and its one-token sequences each as a sequence too)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    query = query.to(kv_cache.dtype)
    plan, block_tables = _plan_for(meta, block_size, None), meta.block_tables
    items = [(p.q_start, p.q_end, p.seq_len, p.block_idx) for p in plan.prefill]
    if plan.decode_rows is not None:
        tok, lens, seq = (t.tolist() for t in plan.decode_rows)
        items += [(t, t + 1, n, block_tables[s, :-(-n // block_size)].long())
                  for t, n, s in zip(tok, lens, seq)]
    out[plan.num_valid_tokens:].zero_()
    for q_start, q_end, seq_len, block_idx in items:
        q_len = q_end - q_start
        kv = cpu_sdpa.context_kv(kv_cache, block_idx, seq_len, group, head_dim)
        q = query[q_start:q_end].transpose(0, 1).reshape(num_kv_heads, group, q_len, head_dim)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale)
        out[q_start:q_end] = o.reshape(num_heads, q_len, head_dim).transpose(0, 1)
    return out
