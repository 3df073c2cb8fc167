"""Where the engine runs and how big its KV cache is: device, dtype, number of blocks.

The one home of the sizing rule, `size_kv_cache`: the engine sizes its cache with it at
start-up (from its loaded model's facts), and the capacity planner (kserve_paged/plan.py)
predicts the same figures from a config.json (from the same facts of a model built on the
meta device, engine/kserve_paged_engine/model_executor/model_facts.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kserve_paged_engine.core.kv_groups import KVLayout, kv_layout
from kserve_paged_engine.model_executor.model_facts import ModelFacts
from kserve_paged_kernels import settings
from kserve_paged_kernels.cpu_dtype import cpu_auto_dtype
from kserve_paged_kernels.cpu_native import isa

# Without an explicit size, the KV cache on CPU takes this share of available RAM, capped.
CPU_KV_FRACTION = 0.25
CPU_KV_CAP_BYTES = 4 << 30
CUDA_KV_FRACTION = 0.85

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None = None,
                  cpu_flags: frozenset[str] | None = None) -> torch.dtype:
    """The one home of the dtype rule. `auto` on CUDA is vLLM's: the checkpoint's dtype
    (`checkpoint_dtype`, config.json's `dtype` / `torch_dtype`), float32 checkpoints (and
    unknown ones) served in bfloat16. `auto` on CPU is ours (kernels/kserve_paged_kernels/cpu_dtype.py): bfloat16
    where the CPU has native bf16 (AVX512-BF16 or AMX), else float32; `cpu_flags` defaults to
    this machine's, and `KSERVE_PAGED_CPU_AUTO_DTYPE` pins it."""
    if name == "auto":
        if device.type == "cuda":
            ckpt = _DTYPES.get(checkpoint_dtype or "")
            return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16
        pinned = settings.cpu_auto_dtype()
        if pinned is not None:
            return _DTYPES[pinned]
        return cpu_auto_dtype(cpu_flags if cpu_flags is not None else isa.cpu_flags())
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {name!r})")
    return _DTYPES[name]


def checkpoint_dtype(model_path: str | os.PathLike[str] | None) -> str | None:
    """config.json's `dtype` (transformers 5) or `torch_dtype` in a model folder, or None."""
    if model_path is None:
        return None
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_budget_bytes(kv_cache_memory: float | int | None, device_type: str,
                    available: int) -> int:
    """Bytes for the KV cache, given what is free once the weights are loaded (``available``):
    ``kv_cache_memory`` bytes (> 1) or that fraction of it (<= 1), else the device's default."""
    mem = kv_cache_memory
    if mem is not None:
        return int(mem * available) if mem <= 1 else int(mem)
    if device_type == "cuda":
        return int(CUDA_KV_FRACTION * available)
    return min(int(CPU_KV_FRACTION * available), CPU_KV_CAP_BYTES)


def kv_bytes_per_block(num_slots: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype_bytes: int, scale_bytes: int = 0) -> int:
    """Bytes of one block id: its K/V in each of `num_slots` per-slot tensors (a layer each),
    plus, in a quantized cache, `scale_bytes` per (K/V half, slot, KV head)
    (kernels/kserve_paged_kernels/kv_formats.py: `element_bytes` and `scale_bytes` of a --kv-cache-dtype)."""
    return (block_size * kv_bytes_per_token(num_slots, num_kv_heads, head_dim, dtype_bytes)
            + 2 * num_slots * num_kv_heads * scale_bytes)


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    layout: KVLayout  # which layers share a block table (engine/kserve_paged_engine/core/kv_groups.py)
    bytes_per_block: int  # one block id in every slot of one rank (a draft model's included)
    num_blocks: int  # 0: the budget holds no block
    budget_bytes: int | None  # what the blocks were cut from (None: their number was given)
    budget_per_block: int  # what one block takes of it (every rank's share on one CPU host)


def size_kv_cache(model: ModelFacts, *, dtype_bytes: int, block_size: int, hybrid: bool,
                  tp: int, device_type: str, num_kv_blocks: int | None,
                  kv_cache_memory: float | int | None, free_bytes: Callable[[], int],
                  extra_bytes_per_block: int = 0, scale_bytes: int = 0) -> KVCacheSize:
    """The KV cache of `model` (one rank's facts): its layout, and the number of blocks given
    outright, from a byte budget or fraction, or a default share of `free_bytes()` (what is
    free once the weights are loaded; asked only when needed). KV groups of their own for
    global and sliding layers when `hybrid` (tensor-parallel workers get every group's tables
    in the step's message, engine/kserve_paged_engine/worker/step_wire.py). A quantized cache (--kv-cache-dtype) passes `dtype_bytes` 1 and its
    `scale_bytes`."""
    layout = kv_layout(list(model.layer_windows), per_group=hybrid)
    per_block = extra_bytes_per_block + kv_bytes_per_block(
        layout.group_size, model.num_kv_heads, model.head_dim, block_size, dtype_bytes,
        scale_bytes)
    # Tensor-parallel ranks on one host share its memory.
    shared = per_block * tp if device_type == "cpu" else per_block
    if num_kv_blocks is not None:
        return KVCacheSize(layout, per_block, num_kv_blocks, None, shared)
    needs_free = kv_cache_memory is None or kv_cache_memory <= 1
    budget = kv_budget_bytes(kv_cache_memory, device_type, free_bytes() if needs_free else 0)
    return KVCacheSize(layout, per_block, max(budget, 0) // shared, budget, shared)
