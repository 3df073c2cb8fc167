"""Memory settings that make CPU serving faster: a caching allocator, huge pages for the KV cache.

Why: every engine step allocates activations of up to tens of MB. glibc serves those with
mmap/munmap, so each step page-faults and zeroes fresh memory; tcmalloc keeps them (the
measured effect is in BENCHMARKS.md). The KV cache is read at random block offsets every decode
step; 2 MiB pages cut the TLB misses of those reads.

- `reexec_with_tcmalloc()`: entry points (server, benchmarks) call it first; when a tcmalloc
  library is found and not yet loaded, the process re-executes itself with it in LD_PRELOAD
  (the allocator must be in place before anything allocates). `KSERVE_PAGED_TCMALLOC=0` skips.
  So that calling it is cheap, this module imports torch only inside the functions that use
  it (tests/test_cpu_memory.py checks that the server's entry point re-executes before torch).
- `tune_glibc_malloc()`: without tcmalloc, keep freed buffers in the heap (mallopt).
- `hugepage_zeros()`: a zero tensor on a fresh anonymous mapping (zeroed lazily by the kernel),
  advised as transparent huge pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kserve_paged_kernels import settings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kserve_paged_engine")

_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library: the system's, or one setup.sh extracted."""
    dirs = [*_SEARCH_DIRS, str(settings.cache_dir() / "lib")]
    for name in _TCMALLOC_NAMES:
        for d in dirs:
            path = Path(d) / name
            if path.is_file():
                return str(path)
    return None


def reexec_with_tcmalloc() -> None:
    """Re-execute this process with tcmalloc preloaded (no return) if it is available and not
    loaded yet; otherwise return. Call before importing anything heavy."""
    if not settings.tcmalloc_enabled() or sys.platform != "linux" or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_tcmalloc()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    argv = [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else [
        sys.executable, *sys.argv]
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # keep running on glibc malloc
        logger.warning("could not re-exec with tcmalloc (%s)", exc)


def tune_glibc_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds so per-step buffers are reused, not unmapped
    and faulted in again. No-op (False) under another allocator or libc."""
    if "tcmalloc" in os.environ.get("LD_PRELOAD", "") or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = mallopt(m_mmap_threshold, 32 << 20) == 1  # glibc's maximum
    ok &= mallopt(m_trim_threshold, 1 << 30) == 1
    ok &= mallopt(m_top_pad, 64 << 20) == 1
    return bool(ok)


def hugepage_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor backed by its own anonymous mapping, advised as transparent huge pages.

    The kernel hands out zeroed pages on first touch, so nothing is written up front: a big KV
    cache costs nothing at start-up (zeroing it was a large share of time-to-ready), and only
    the blocks that are used ever get memory. Off Linux, or for small tensors, plain zeros.
    """
    import torch

    from kserve_paged_kernels.cpu_native.huge_pages import HUGE_PAGE, mapping_tensor

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if sys.platform != "linux" or nbytes < 4 * HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return mapping_tensor(nbytes).view(dtype).view(shape)


def prefault_bytes() -> int:
    """Bytes of KV cache whose pages are touched at start-up (settings.KV_PREFAULT_MIB)."""
    return max(settings.kv_prefault_mib(), 0) << 20


def prefault_leading_blocks(caches: list[torch.Tensor], num_blocks: int) -> None:
    """Touch every page of blocks [0, num_blocks) of each `[2, blocks, ...]` KV cache.

    Why: see worker/kv_prefault.py, which populates the same pages in the background where
    the kernel can do so without writing; this is its fallback, in the foreground (it writes
    a zero to each page, so nothing may be stored there yet). Blocks beyond stay lazy.
    """
    import torch

    page = max(mmap.PAGESIZE // caches[0].element_size(), 1) if caches else 1
    with torch.no_grad():
        for cache in caches:
            for half in cache[:, :num_blocks]:
                half.reshape(-1)[::page].zero_()  # contiguous view: one write per page
