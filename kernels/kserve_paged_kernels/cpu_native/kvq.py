"""A quantized KV cache on the native library: the store and paged attention over the codes
(`csrc/kv_q8.c`, `csrc/paged_q8.c`).

The cache is a `QuantKV`'s two tensors (kernels/kserve_paged_kernels/kv_quant.py): `codes` `[2, num_blocks,
block_size, kv_heads, head_dim]` of int8 / float8_e4m3fn / float8_e5m2 and `scales` float32
`[2, num_blocks, kv_heads]`. The store writes the same codes and scales as the PyTorch store;
attention widens each code and applies its scale in fp32. The convention for "cannot run
here" is the package's: None, nothing done (kernels/kserve_paged_kernels/cpu_native/__init__.py).
"""

from __future__ import annotations

from typing import Literal

import torch

from kserve_paged_kernels.cpu_native.abi import KV_FORMATS
from kserve_paged_kernels.cpu_native.loader import load, sync_threads

_FORMAT = {getattr(torch, name): code for name, code in KV_FORMATS.items()}


def kv_format(codes: torch.Tensor) -> int | None:
    """The KP_KV_* format of a code tensor, or None when the kernels read no such cache."""
    return _FORMAT.get(codes.dtype)


def _cache_ok(codes: torch.Tensor, scales: torch.Tensor) -> bool:
    return (codes.device.type == "cpu" and codes.dim() == 5 and codes.shape[0] == 2
            and codes.is_contiguous() and kv_format(codes) is not None
            and scales.dtype == torch.float32 and scales.is_contiguous()
            and tuple(scales.shape) == (2, codes.shape[1], codes.shape[3])
            and codes.shape[2] <= 256 and codes.shape[4] <= 256)


def kvq_usable(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `paged_rows_q8` takes this query (any float dtype: it runs in fp32) and cache."""
    heads, kv_heads = query.shape[1], codes.shape[3]
    return (query.device.type == "cpu" and query.is_floating_point() and _cache_ok(codes, scales)
            and heads % kv_heads == 0 and heads // kv_heads <= 32
            and query.shape[2] == codes.shape[4] and load() is not None)


def store_kv_q8(key: torch.Tensor, value: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor, slot_mapping: torch.Tensor) -> Literal[True] | None:
    """Quantize key/value `[tokens, kv_heads, head_dim]` into their slots (< 0 skipped), as
    kernels/kserve_paged_kernels/kv_quant.py's `store_kv_quant` does, code for code: True, or None (nothing done)
    when the tensors are not in the kernel's layout; IndexError for a slot past the cache."""
    lib = load()
    if (lib is None or not _cache_ok(codes, scales) or key.dim() != 3 or value.shape != key.shape
            or tuple(key.shape[1:]) != tuple(codes.shape[3:]) or key.device.type != "cpu"
            or slot_mapping.numel() != key.shape[0]):
        return None
    k = key.float().reshape(key.shape[0], -1).contiguous()
    v = value.float().reshape(value.shape[0], -1).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = lib.kp_store_kv_q8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                            slots.data_ptr(), slots.numel(), codes.data_ptr(), scales.data_ptr(),
                            codes.shape[1], codes.shape[2], codes.shape[3], codes.shape[4],
                            kv_format(codes))
    if rc == -2:
        raise MemoryError("native quantized KV store could not allocate its scratch")
    if rc != 0:
        raise IndexError(f"a KV slot is outside the cache of {codes.shape[1] * codes.shape[2]} "
                         "slots")
    return True


def paged_rows_q8(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  block_tables: torch.Tensor, row_lens: torch.Tensor, token_idx: torch.Tensor,
                  seq_idx: torch.Tensor, scale: float, out: torch.Tensor, *,
                  window: int | None = None, softcap: float | None = None) -> None:
    """`cpu_native.paged_rows` over a quantized cache (check `kvq_usable` first): `query` and
    `out` float32 `[num_tokens, num_heads, head_dim]` with contiguous rows; same row meaning,
    `window` and `softcap`."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not loaded (check kvq_usable() first)")
    if query.dtype != torch.float32 or out.dtype != torch.float32 or query.stride(2) != 1 or (
            query.stride(1) != query.shape[2] or out.stride(2) != 1
            or out.stride(1) != out.shape[2]):
        raise ValueError("query and out must be float32 with contiguous [heads, head_dim] rows")
    bt = block_tables.to(torch.int32).contiguous()
    lens = row_lens.to(torch.int32).contiguous()
    tok, seq = token_idx.long().contiguous(), seq_idx.long().contiguous()
    if not (tok.numel() == seq.numel() == lens.numel()):
        raise ValueError("token_idx, seq_idx and row_lens must have one entry per row")
    sync_threads(lib)
    rc = lib.kp_paged_rows_q8(
        query.data_ptr(), query.stride(0), codes.data_ptr(), scales.data_ptr(),
        kv_format(codes), codes.shape[1], codes.shape[2], codes.shape[3], codes.shape[4],
        query.shape[1], bt.data_ptr(), bt.stride(0), lens.data_ptr(), tok.data_ptr(),
        seq.data_ptr(), tok.numel(), float(scale), int(window or 0), float(softcap or 0.0),
        out.data_ptr(), out.stride(0))
    if rc == -2:
        raise MemoryError("native paged attention could not allocate its scratch")
    if rc != 0:
        raise ValueError("native paged attention: shape, window or softcap outside the kernel's "
                         "limits")
