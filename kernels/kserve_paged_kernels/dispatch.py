"""Paged-attention kernels: KV store and varlen paged attention (contract: docs/kernels.md).

Backends: `cpu` (the native C row kernel in fp32, else batched gathers + SDPA; the CPU
serving path), `triton` (CUDA, or CPU under
`TRITON_INTERPRET=1` for tests), `flash_attn` (CUDA, when `flash_attn` imports and the block
size suits its paged API). Selection, first match wins:

1. the `backend=` keyword,
2. the env var `KSERVE_PAGED_ATTENTION_BACKEND` (cpu | triton | flash_attn;
   `torch`, the old name of `cpu`, is still accepted),
3. the device: CUDA -> flash_attn if importable and usable, else triton; anything else -> cpu.

An unusable flash_attn (not importable, block size not a multiple of 256, ...) falls back to
triton with the reason logged. Every distinct choice is logged once on the "kserve_paged_kernels" logger.
This module imports only torch (and triton lazily, when the triton backend is used).
"""

from __future__ import annotations

import logging
import os

import torch

import kserve_paged_kernels as kernels
from kserve_paged_kernels import cpu_native, settings
from kserve_paged_kernels.block_copy import copy_blocks  # noqa: F401 - re-exported by the package
from kserve_paged_kernels.cpu_backend import (
    bidirectional_attention_cpu,
    paged_attention_cpu,
    store_kv_cpu,
)
from kserve_paged_kernels.kv_quant import QuantKV, store_kv_quant
from kserve_paged_kernels.metadata import AttentionMetadata

__all__ = list(kernels.__all__)  # the package re-exports exactly these

logger = logging.getLogger("kserve_paged_kernels")

BACKENDS = ("cpu", "triton", "flash_attn")
# Older name of the CPU backend, still accepted (in the env variable too).
_ALIASES = {"torch": "cpu"}
ENV_VAR = settings.ATTENTION_BACKEND.name

_logged: set[tuple] = set()


def _log_once(key: tuple, msg: str, *args: object, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _triton_runnable(device: torch.device) -> str | None:
    """None if Triton can run on `device`, else why not."""
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return (f"Triton needs a CUDA device (got {device.type}); on CPU set TRITON_INTERPRET=1 "
            "before triton is imported (tests only, it is slow)")


def resolve_backend(device: torch.device | str, backend: str | None = None, *,
                    block_size: int | None = None, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> str:
    """Name of the backend a call with these properties uses (see module docstring)."""
    device = torch.device(device)
    source = "argument"
    if backend is None:
        env = settings.attention_backend()
        backend, source = (env, f"env {ENV_VAR}") if env else (None, "default")
    if backend is not None:
        backend = backend.strip().lower().replace("-", "_")
        backend = _ALIASES.get(backend, backend)
        if backend not in BACKENDS:
            raise ValueError(f"unknown paged-attention backend {backend!r} (from {source}); "
                             f"expected one of {', '.join(BACKENDS)}")
    else:
        backend = "flash_attn" if device.type == "cuda" else "cpu"
    if backend == "flash_attn":
        from kserve_paged_kernels import flash_attn_backend

        why = flash_attn_backend.unusable_reason(device, block_size, head_dim, dtype)
        if why is not None:
            _log_once(("fallback", why), "flash_attn backend not used (%s); using triton", why,
                      level=logging.INFO if source == "default" else logging.WARNING)
            backend = "triton"
    if backend == "triton":
        why = _triton_runnable(device)
        if why is not None:
            if source == "default":  # only reachable via the flash_attn fallback off CUDA
                backend = "cpu"
            else:
                raise ValueError(f"backend 'triton' (from {source}) cannot run: {why}")
    _log_once((backend, device.type, source), "paged-attention backend: %s (device %s, %s)",
              backend, device.type, source)
    return backend


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | QuantKV,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into their slots (< 0: skipped);
    a quantized cache (`QuantKV`) gets codes and scales (kernels/kserve_paged_kernels/kv_quant.py; the same codes
    by the native store on CPU and the Triton store on CUDA, one pass each)."""
    if isinstance(kv_cache, QuantKV):
        if kv_cache.device.type == "cuda":
            from kserve_paged_kernels.kv_quant_triton import store_kv_quant_triton

            store_kv_quant_triton(key, value, kv_cache, slot_mapping)
        elif not cpu_native.store_kv_q8(key, value, kv_cache.data, kv_cache.scales,
                                        slot_mapping):
            store_kv_quant(key, value, kv_cache, slot_mapping)
        return
    name = resolve_backend(kv_cache.device, backend)
    if name == "cpu":
        store_kv_cpu(key, value, kv_cache, slot_mapping)
    else:  # flash_attn reads the same layout; the Triton store serves both
        from kserve_paged_kernels.triton_backend import store_kv_triton

        store_kv_triton(key, value, kv_cache, slot_mapping)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor | QuantKV,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    backend: str | None = None, max_seq_len: int | None = None,
                    max_query_len: int | None = None, window: int | None = None,
                    softcap: float | None = None, causal: bool = True,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal attention of the new tokens over their paged context, from raw tensors.

    `max_seq_len` / `max_query_len` are optional host-side hints (max of `seq_lens` and of the
    query lengths); callers that know them save the GPU backends a device-to-host sync. The
    engine calls `attend` with the step's `AttentionMetadata` instead.
    """
    meta = AttentionMetadata.build(block_tables, seq_lens, query_start_loc,
                                   max_seq_len=max_seq_len, max_query_len=max_query_len,
                                   backend=backend)
    return attend(query, kv_cache, meta, scale, window=window, softcap=softcap, causal=causal,
                  sinks=sinks)


def attend(query: torch.Tensor, kv_cache: torch.Tensor | QuantKV, meta: AttentionMetadata,
           scale: float, *, window: int | None = None,
           softcap: float | None = None, causal: bool = True,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` over a step's metadata, on the backend it names (the runner resolves
    it once; checked again here, which is cheap, so a hand-built metadata is checked too).

    `window` (a sliding-window layer: each token sees its last `window` positions) and
    `softcap` (tanh capping of the scores) are the calling layer's own: one step's metadata
    serves layers with and without them (Gemma alternates), so they come with the call.
    `causal` False: bidirectional attention (encoders), each new token over its sequence's
    whole context; no window or softcap with it. `sinks` (`[num_heads]` float32, gpt-oss):
    each head's learned logit added to its softmax's denominator (`reference.paged_attention_ref`);
    flash-attn's paged API takes none, so such a layer's steps run on Triton there.
    """
    if window is not None and window <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if not causal and (window is not None or softcap or sinks is not None):
        raise ValueError("bidirectional attention takes no sliding window, softcap or sinks")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"sinks must have one logit per query head ({query.shape[1]}), "
                         f"got shape {tuple(sinks.shape)}")
    name = resolve_backend(query.device, meta.backend, block_size=kv_cache.shape[2],
                           head_dim=query.shape[-1], dtype=query.dtype)
    if isinstance(kv_cache, QuantKV):
        return _attend_quant(name, query, kv_cache, meta, scale, window, softcap, causal, sinks)
    if name == "cpu":
        if not causal:
            return bidirectional_attention_cpu(query, kv_cache, meta, scale)
        return paged_attention_cpu(query, kv_cache, meta, scale, window=window, softcap=softcap,
                                   sinks=sinks)
    hints = {"max_seq_len": meta.max_seq_len, "max_query_len": meta.max_query_len,
             "window": window, "softcap": softcap}
    if not causal:
        hints["causal"] = False
    if sinks is not None:
        hints["sinks"] = sinks
    args = (query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    if name == "flash_attn" and sinks is not None:
        _log_once(("flash_sinks",), "flash_attn backend not used for attention-sink layers "
                  "(its paged API takes no sinks); those layers run on triton",
                  level=logging.WARNING)
        name = "triton"
    if name == "flash_attn":
        from kserve_paged_kernels.flash_attn_backend import paged_attention_flash

        return paged_attention_flash(*args, **hints)
    from kserve_paged_kernels.triton_backend import paged_attention_triton

    return paged_attention_triton(*args, **hints)


def _attend_quant(name: str, query: torch.Tensor, kv: QuantKV, meta: AttentionMetadata,
                  scale: float, window: int | None, softcap: float | None,
                  causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` over a quantized cache: the CPU backend over dequantized blocks, else Triton
    (flash-attn reads no int8/fp8 cache with our scales, so its steps take Triton)."""
    if name == "cpu":
        from kserve_paged_kernels.cpu_kvq import attention_quant_cpu

        return attention_quant_cpu(query, kv, meta, scale, window=window, softcap=softcap,
                                   causal=causal, sinks=sinks)
    from kserve_paged_kernels.triton_backend import paged_attention_triton

    return paged_attention_triton(query, kv.data, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, scale, max_seq_len=meta.max_seq_len,
                                  max_query_len=meta.max_query_len, window=window,
                                  softcap=softcap, causal=causal, kv_scales=kv.scales,
                                  sinks=sinks)
