"""A small C kernel for paged decode attention on CPU, built with the system C compiler.

Why: on CPU the PyTorch path copies every decode row's blocks into a contiguous tensor and
reads that copy again in SDPA; decode is bound by that memory traffic. `csrc/paged_decode.c`
reads each K/V row once, for all query heads of its group. It is plain C called through
ctypes (no PyTorch headers), so building it takes about a second; the library is cached under
`$KSERVE_PAGED_CACHE/native` (else `~/.cache/kserve-paged/native`) keyed by the source's hash.
If no compiler is found or the build fails, `load()` returns None (the reason is logged once)
and the PyTorch path serves. `KSERVE_PAGED_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("KSERVE_PAGED_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "kserve-paged"
    return root / "native"


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: a half-written library is never loaded
    return target


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("KSERVE_PAGED_NATIVE", "1").strip().lower() in ("0", "false", "no"):
        logger.info("native CPU decode kernel disabled by KSERVE_PAGED_NATIVE")
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU decode kernel unavailable (%s); using the PyTorch path", exc)
        return None
    fn = lib.kp_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_int64]
    lib.kp_set_threads.argtypes = [ctypes.c_int]
    _lib = lib
    logger.info("native CPU decode kernel loaded")
    return _lib


def usable(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp32 CPU tensors in the contract's contiguous layout, within the kernel's limits."""
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu"
            and query.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and query.stride(2) == 1 and query.stride(1) == head_dim
            and heads // kv_heads <= 32 and head_dim <= 256 and block_size <= 256
            and load() is not None)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, token_idx: torch.Tensor, seq_idx: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
    """Write attention of query rows `token_idx` (one new token of sequence `seq_idx` each)
    into the same rows of `out` ([num_tokens, num_heads, head_dim], contiguous rows)."""
    lib = load()
    assert lib is not None
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    bt, sl = bt.contiguous(), sl.contiguous()
    tok = token_idx.contiguous()
    seq = seq_idx.contiguous()
    lib.kp_set_threads(torch.get_num_threads())
    rc = lib.kp_paged_decode_f32(
        query.data_ptr(), query.stride(0), kv_cache.data_ptr(), kv_cache.shape[1],
        kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4], query.shape[1],
        bt.data_ptr(), bt.stride(0), sl.data_ptr(), tok.data_ptr(), seq.data_ptr(),
        tok.numel(), float(scale), out.data_ptr(), out.stride(0))
    if rc != 0:
        raise ValueError("native paged decode: shape outside the kernel's limits")
