"""Paged attention and the fused elementwise ops of a layer, over the native library.

`csrc/paged_*.c` reads each K/V row once, for all query heads of its group, straight from the
paged cache. `csrc/cpu_ops.c` fuses a layer's elementwise work (residual add + RMSNorm, the
per-head q/k norm and RoPE in place, SiLU-and-multiply, KV store, greedy argmax) into one pass
each. The convention for "cannot run here" is the package's (kernels/kserve_paged_kernels/cpu_native/__init__.py).
"""

from __future__ import annotations

import ctypes
from typing import Literal

import torch

from kserve_paged_kernels.cpu_native.loader import load, loaded, sync_threads


def usable(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp32 or bf16 CPU tensors (query and cache of one dtype) in the contract's contiguous
    layout, within the kernel's limits. bf16 goes to `kp_paged_rows_bf16` (fp32 softmax and
    sums; prefill tiles for the head dims of `bf16_prefill_tiles`)."""
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16) and kv_cache.dtype == query.dtype
            and kv_cache.is_contiguous() and query.stride(2) == 1 and query.stride(1) == head_dim
            and heads // kv_heads <= 32 and head_dim <= 256 and block_size <= 256
            and load() is not None)


TILE_HEAD_DIMS = (64, 128)  # pa_vector_head in csrc/paged_attention.h


def bf16_prefill_tiles(head_dim: int) -> bool:
    """Whether bf16 prefill runs of this head dim get the transposed-key tiles
    (csrc/paged_bf16_tile.c; without a window or cap); other rows run the row kernel."""
    return head_dim in TILE_HEAD_DIMS and load() is not None


def paged_rows(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               row_lens: torch.Tensor, token_idx: torch.Tensor, seq_idx: torch.Tensor,
               scale: float, out: torch.Tensor, *, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Write attention of query rows `token_idx` into the same rows of `out`
    (`[num_tokens, num_heads, head_dim]`, heads contiguous in a row). Row r belongs to the
    sequence whose block-table row is `seq_idx[r]` and attends to its first `row_lens[r]` keys:
    the whole context for a decode token, `position + 1` keys for a prefill token (causality).
    `window`: only the last `window` of them (a sliding-window layer; the blocks before are not
    read). `softcap`: scaled scores s become `softcap * tanh(s / softcap)` before the softmax.
    `sinks` (`[num_heads]`, any float dtype): each head's attention-sink logit, `exp(sink)`
    added to its softmax's denominator (`kp_paged_rows_sinks_*`).
    Tensors all fp32, or all bf16 (fp32 softmax and sums inside, outputs rounded once)."""
    lib = loaded()
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = row_lens if row_lens.dtype == torch.int32 else row_lens.int()
    bt, lens = bt.contiguous(), lens.contiguous()
    tok = token_idx.long().contiguous()
    seq = seq_idx.long().contiguous()
    if not (tok.numel() == seq.numel() == lens.numel()):
        raise ValueError("token_idx, seq_idx and row_lens must have one entry per row")
    if not query.dtype == kv_cache.dtype == out.dtype or query.dtype not in (torch.float32,
                                                                                torch.bfloat16):
        raise ValueError("query, kv_cache and out must be all float32 or all bfloat16")
    sync_threads(lib)
    args = (query.data_ptr(), query.stride(0), kv_cache.data_ptr(), kv_cache.shape[1],
            kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4], query.shape[1],
            bt.data_ptr(), bt.stride(0), lens.data_ptr(), tok.data_ptr(), seq.data_ptr(),
            tok.numel(), float(scale), int(window or 0), float(softcap or 0.0))
    if sinks is not None:
        if sinks.numel() != query.shape[1]:
            raise ValueError(f"sinks: one logit per query head ({query.shape[1]}), "
                             f"got {sinks.numel()}")
        sink32 = sinks.detach().to("cpu", torch.float32).contiguous()
        fn = (lib.kp_paged_rows_sinks_f32 if query.dtype == torch.float32
              else lib.kp_paged_rows_sinks_bf16)
        rc = fn(*args, sink32.data_ptr(), out.data_ptr(), out.stride(0))
    else:
        fn = lib.kp_paged_rows_f32 if query.dtype == torch.float32 else lib.kp_paged_rows_bf16
        rc = fn(*args, out.data_ptr(), out.stride(0))
    if rc == -2:
        raise MemoryError("native paged attention could not allocate its scratch")
    if rc != 0:
        raise ValueError("native paged attention: shape, window or softcap outside the kernel's limits")


def f32_rows(t: torch.Tensor) -> bool:
    """fp32 CPU rows with unit stride inside a row (the C kernels' layout)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and (
        t.stride(1) == 1 or t.shape[1] == 1)


def rows_of(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """CPU rows of `dtype` with unit stride inside a row (the C kernels' layout)."""
    return t.device.type == "cpu" and t.dtype == dtype and t.dim() == 2 and (
        t.stride(1) == 1 or t.shape[1] == 1)


_BF16_OR_F32 = (torch.float32, torch.bfloat16)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """`weight * rmsnorm(x (+ residual))` in one pass, `residual` updated in place to the sum;
    None (nothing done) when the tensors are not in the kernel's layout. fp32, or bf16 (every
    tensor; fp32 inside, rounded where transformers rounds)."""
    lib = load()
    dt = x.dtype
    if (lib is None or dt not in _BF16_OR_F32 or not rows_of(x, dt) or not weight.is_contiguous()
            or weight.dtype != dt or x.shape[1] != weight.shape[0]
            or (residual is not None and (not residual.is_contiguous()
                                          or residual.dtype != dt
                                          or residual.shape != x.shape))):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    sync_threads(lib)
    fn = lib.kp_add_rms_norm_f32 if dt == torch.float32 else lib.kp_add_rms_norm_bf16
    fn(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
       weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def qk_norm_inplace(qkv: torch.Tensor, q_heads: int, k_heads: int, head_dim: int,
                    q_weight: torch.Tensor, k_weight: torch.Tensor,
                    eps: float) -> Literal[True] | None:
    """Qwen3's per-head RMSNorm of q and k in place on fused qkv rows (the first `q_heads`
    heads times `q_weight`, the next `k_heads` times `k_weight`): True, or None (nothing done)
    when the tensors are not in the kernel's layout."""
    lib = load()
    if (lib is None or not f32_rows(qkv) or qkv.shape[1] < (q_heads + k_heads) * head_dim
            or any(w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu"
                   or w.shape != (head_dim,) for w in (q_weight, k_weight))):
        return None
    sync_threads(lib)
    lib.kp_qk_norm_f32(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], q_heads, k_heads, head_dim,
                       q_weight.data_ptr(), k_weight.data_ptr(), eps)
    return True


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: int, head_dim: int) -> Literal[True] | None:
    """Rotate the first `heads` heads of each row of `x` in place: True, or None (nothing
    done) when the tensors are not in the kernel's layout; IndexError for a position past the
    rotary table. fp32, or bf16 rows with a bf16 table (each product and sum rounded)."""
    lib = load()
    dt = x.dtype
    if (lib is None or dt not in _BF16_OR_F32 or not rows_of(x, dt)
            or x.shape[1] < heads * head_dim or head_dim % 2
            or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos.dtype != dt or sin.dtype != dt
            or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape[-1] * 2 != head_dim or positions.numel() != x.shape[0]):
        return None
    sync_threads(lib)
    fn = lib.kp_rope_f32 if dt == torch.float32 else lib.kp_rope_bf16
    rc = fn(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], x.shape[0], heads, head_dim)
    if rc != 0:
        raise IndexError(f"a position is outside the rotary table of {cos.shape[0]} positions")
    return True


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> Literal[True] | None:
    """Copy rows of key/value (`[tokens, kv_heads, head_dim]`, each row contiguous) into their
    slots of the fp32 or bf16 paged cache (slots < 0 skipped): True, or None (nothing done)
    when the tensors are not in that layout; IndexError for a slot past the cache."""
    lib = load()
    dt = kv_cache.dtype
    if (lib is None or dt not in _BF16_OR_F32 or key.dtype != dt
            or value.dtype != dt or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous() or key.dim() != 3 or value.shape != key.shape
            or key.shape[1:] != kv_cache.shape[3:]):
        return None
    row = key.shape[1] * key.shape[2]
    if (key.stride(2) != 1 or key.stride(1) != key.shape[2] or value.stride(2) != 1
            or value.stride(1) != value.shape[2] or slot_mapping.numel() != key.shape[0]):
        return None
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    fn = lib.kp_store_kv_f32 if dt == torch.float32 else lib.kp_store_kv_bf16
    rc = fn(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            slot_mapping.data_ptr(), key.shape[0], kv_cache.data_ptr(), num_slots, row)
    if rc != 0:
        raise IndexError(f"a KV slot is outside the cache of {num_slots} slots")
    return True


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor,
                dst: torch.Tensor) -> Literal[True] | None:
    """Block dst[i] := block src[i] in every layer cache (`[2, num_blocks, ...]`, contiguous
    CPU tensors of one shape and dtype, any dtype): True, or None (nothing done) when the
    caches are not in that layout; IndexError for a block past the cache."""
    lib = load()
    if lib is None or not kv_caches:
        return None
    first = kv_caches[0]
    if first.device.type != "cpu" or first.dim() < 2 or first.shape[0] != 2 or any(
            c.shape != first.shape or c.dtype != first.dtype or c.device.type != "cpu"
            or not c.is_contiguous() for c in kv_caches):
        return None
    src = src.to("cpu", torch.int64).contiguous()
    dst = dst.to("cpu", torch.int64).contiguous()
    if src.numel() != dst.numel():
        raise ValueError("src and dst must list the same number of blocks")
    num_blocks = first.shape[1]
    block_bytes = first[0, 0].numel() * first.element_size()
    ptrs = (ctypes.c_void_p * len(kv_caches))(*[c.data_ptr() for c in kv_caches])
    rc = lib.kp_copy_blocks(ptrs, len(kv_caches), num_blocks, block_bytes, src.data_ptr(),
                            dst.data_ptr(), src.numel())
    if rc != 0:
        raise IndexError(f"a block index is outside the cache of {num_blocks} blocks")
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` for a fused `[rows, 2 * inter]` projection (fp32, or bf16 with SiLU
    rounded before the multiply, as in eager bf16); None when not applicable."""
    lib = load()
    dt = gate_up.dtype
    if (lib is None or dt not in _BF16_OR_F32 or not rows_of(gate_up, dt)
            or not gate_up.is_contiguous() or gate_up.shape[1] % 2):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    sync_threads(lib)
    fn = lib.kp_silu_mul_f32 if dt == torch.float32 else lib.kp_silu_mul_bf16
    fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(-1)` (int64) for fp32 CPU rows, same tie and NaN rules; None when `x` is not
    in the kernel's layout, so the caller uses torch."""
    lib = load()
    if lib is None or not f32_rows(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    sync_threads(lib)
    lib.kp_argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
