"""Paged-attention kernels: KV store and varlen paged attention (contract: docs/kernels.md).

The public functions live in `kserve_paged_kernels.dispatch` (backend selection) and are re-exported here
on first use: importing the package, or `kserve_paged_kernels.settings`, loads no torch, so a process entry
point can read its settings and re-execute itself before anything heavy is imported
(engine/kserve_paged_engine/worker/cpu_memory.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kserve_paged_kernels import cpu_cap

cpu_cap.apply()  # `KSERVE_PAGED_ISA` caps oneDNN, ATen and MKL too, before their first use

__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "attend",
    "copy_blocks",
    "ENV_VAR",
    "paged_attention",
    "paged_attention_ref",
    "resolve_backend",
    "store_kv",
    "store_kv_ref",
]

if TYPE_CHECKING:
    from kserve_paged_kernels.dispatch import (
        BACKENDS,
        ENV_VAR,
        AttentionMetadata,
        attend,
        copy_blocks,
        paged_attention,
        paged_attention_ref,
        resolve_backend,
        store_kv,
        store_kv_ref,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kserve_paged_kernels import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'kserve_paged_kernels' has no attribute {name!r}")
