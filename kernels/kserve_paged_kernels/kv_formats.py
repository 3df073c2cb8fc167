"""The KV-cache storage formats (`--kv-cache-dtype`): their names and sizes, the one home of both.

Torch-free (the engine's config validates against it before torch loads). `auto` keeps K/V in
the model's dtype; the others store one byte per element plus a float32 scale per block, KV
head and K/V half (kernels/kserve_paged_kernels/kv_quant.py says how they are written and read):

- `fp8` / `fp8_e4m3`, `fp8_e5m2`: vLLM's values, stored as torch.float8_e4m3fn / float8_e5m2;
- `int8`: ours (not vLLM's), symmetric int8 codes in -127..127.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
QUANTIZED = frozenset(KV_CACHE_DTYPES) - {"auto"}
SCALE_BYTES = 4  # one float32 scale per (K/V half, block, KV head)


def canonical(name: str) -> str:
    """`fp8` is vLLM's alias of `fp8_e4m3`; ValueError for a name no format has."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(got {name!r}); int8 is this engine's own, the others are vLLM's")
    return "fp8_e4m3" if name == "fp8" else name


def is_quantized(name: str) -> bool:
    return canonical(name) in QUANTIZED


def element_bytes(name: str, model_dtype_bytes: int) -> int:
    """Bytes of one stored K or V element: the model dtype's under `auto`, else one."""
    return 1 if is_quantized(name) else model_dtype_bytes


def scale_bytes(name: str) -> int:
    """Bytes of the scales of one (K/V half, block, KV head): 4 when quantized, else 0."""
    return SCALE_BYTES if is_quantized(name) else 0
