"""Where the engine runs and how big its KV cache is: device, dtype, number of blocks.

The one home of the sizing rule: the engine sizes its cache with it at start-up, and the
capacity planner (kserve_paged/plan.py) predicts the same figures from a config.json."""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {name!r})")
    return _DTYPES[name]


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


def size_kv_cache(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """Number of KV blocks: given outright, from a byte budget or fraction, or a default share."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cpu":  # tensor-parallel ranks on one host share its memory
        bytes_per_block *= config.tensor_parallel_size
    needs_free = config.kv_cache_memory is None or config.kv_cache_memory <= 1
    budget = kv_budget_bytes(config.kv_cache_memory, device.type,
                             available_memory(device) if needs_free else 0)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block "
                         f"({bytes_per_block} bytes each)")
    return blocks
