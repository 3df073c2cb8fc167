"""Where the engine runs and how big its KV cache is: device, dtype, number of blocks."""

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


def size_kv_cache(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """Number of KV blocks: given outright, from a byte budget or fraction, or a default share."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    mem = config.kv_cache_memory
    if mem is not None:
        budget = int(mem * available_memory(device)) if mem <= 1 else int(mem)
    elif device.type == "cuda":
        budget = int(CUDA_KV_FRACTION * available_memory(device))
    else:
        budget = min(int(CPU_KV_FRACTION * available_memory(device)), CPU_KV_CAP_BYTES)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block "
                         f"({bytes_per_block} bytes each)")
    return blocks
