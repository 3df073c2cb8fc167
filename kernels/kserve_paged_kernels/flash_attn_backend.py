"""flash-attn 2 backend: `flash_attn_varlen_func` with a block table over our NHD paged cache.

Used only when `flash_attn` imports and the call fits its paged API. Upstream flash-attn 2
requires the paged block size to be a multiple of 256 (our default is 16), so in practice the
dispatcher falls back to Triton unless the engine runs with `block_size=256` or larger.
flash-attn aligns the causal mask bottom-right when seqlen_q < seqlen_k, which is exactly our
"query token j sits at position seq_len - q_len + j" rule.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

__all__ = ["paged_attention_flash", "unusable_reason"]

_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


@functools.cache
def _flash_attn() -> ModuleType | str:
    """The imported module, or why it does not import."""
    try:
        import flash_attn
    except Exception as exc:  # ImportError, or a broken CUDA extension
        return f"flash_attn does not import: {type(exc).__name__}: {exc}"
    if not hasattr(flash_attn, "flash_attn_varlen_func"):
        return "flash_attn has no flash_attn_varlen_func"
    return flash_attn


def unusable_reason(device: torch.device, block_size: int | None, head_dim: int | None,
                    dtype: torch.dtype | None) -> str | None:
    """None when flash-attn can serve a call with these properties, else a reason to log."""
    if device.type != "cuda":
        return f"flash_attn needs CUDA, device is {device.type}"
    mod = _flash_attn()
    if isinstance(mod, str):
        return mod
    if block_size is not None and block_size % 256:
        return f"flash_attn paged KV needs block_size % 256 == 0, got {block_size}"
    if head_dim is not None and head_dim not in _HEAD_DIMS:
        return f"flash_attn does not support head_dim {head_dim}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn needs fp16/bf16, got {dtype}"
    return None


def paged_attention_flash(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Varlen paged attention through flash-attn (contract in docs/kernels.md); a sliding
    window is flash-attn's `window_size=(window - 1, 0)`, softcap its `softcap`."""
    mod = _flash_attn()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if max_query_len is None:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(q_lens.max().item()) if q_lens.numel() else 0
    if max_query_len == 0:
        return torch.zeros_like(query)
    cu_k = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=query.device)
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    extra: dict[str, object] = {}  # only when used: older flash-attn lacks softcap
    if window:
        extra["window_size"] = (window - 1, 0)
    if softcap:
        extra["softcap"] = softcap
    res = mod.flash_attn_varlen_func(
        query, kv_cache[0], kv_cache[1],
        cu_seqlens_q=query_start_loc.int(), cu_seqlens_k=cu_k,
        max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=True, block_table=block_tables.int().contiguous(), **extra)
    # Tokens past query_start_loc[-1] (padding) are left undefined by flash-attn; the
    # contract gives zeros. A masked fill keeps it free of host syncs.
    valid = torch.arange(query.shape[0], device=query.device) < query_start_loc[-1]
    return res.masked_fill(~valid.view(-1, 1, 1), 0)
