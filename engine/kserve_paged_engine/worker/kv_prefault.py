"""The KV cache's leading pages made resident in the background, after the engine is up.

Why: a lazily zeroed mapping pays for each page on its first write, and on a VM whose memory
the host backs on demand that is several seconds per GiB. Blocks are handed out from id 0 up,
so the first requests land on the leading blocks; making those pages resident before they are
written keeps that cost out of the first requests' steps. Done in the foreground, it was most
of the server's time to ready, so it runs on a thread of its own with
`madvise(MADV_POPULATE_WRITE)`: the kernel faults the pages in as a write would but never
writes to them, so a block the engine has already filled keeps its contents and the thread
needs no lock against the engine. It runs at the lowest priority, so it takes the time the
engine's steps leave. The offline `LLM` waits for it before it returns (its users measure
throughput, not readiness); the server answers ready at once.

Where the kernel lacks it (before Linux 5.14) or the platform is not Linux, the pages are
touched in the foreground as before (`cpu_memory.prefault_leading_blocks`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from kserve_paged_engine.worker.cpu_memory import prefault_leading_blocks

logger = logging.getLogger("kserve_paged_engine")

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python 3.11's mmap module does not name it
ROUND_BYTES = 2 << 20  # each cache's next 2 MiB per round, so every layer's leading blocks come first


Madvise = Callable[[int, int, int], int]


def _madvise() -> Madvise | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class KVPrefault:
    """Makes blocks [0, num_blocks) of each `[2, blocks, ...]` cache resident: on a background
    thread where the kernel can populate without writing, else in the constructor."""

    def __init__(self, caches: list[torch.Tensor], num_blocks: int) -> None:
        self.seconds: float | None = None
        self._thread: threading.Thread | None = None
        spans = [(half.data_ptr(), half[:num_blocks].numel() * half.element_size())
                 for cache in caches for half in cache] if num_blocks > 0 else []
        spans = [(addr, size) for addr, size in spans if size > 0]
        if not spans:
            self.seconds = 0.0
            return
        self._caches = caches  # the mappings stay alive while the thread reads their addresses
        madvise = _madvise()
        if madvise is None or not self._populate(madvise, *self._page(spans[0], 0, mmap.PAGESIZE)):
            t0 = time.monotonic()
            prefault_leading_blocks(caches, num_blocks)
            self.seconds = time.monotonic() - t0
            return
        self._thread = threading.Thread(target=self._run, args=(madvise, spans),
                                        name="kv-prefault", daemon=True)
        self._thread.start()

    @staticmethod
    def _page(span: tuple[int, int], offset: int, length: int) -> tuple[int, int]:
        """The page-aligned (address, length) covering `length` bytes at `offset` into span
        (its start rounded down: a neighbour's page is populated, never written)."""
        addr, size = span
        start = addr + offset
        end = min(start + length, addr + size)
        aligned = start & ~(mmap.PAGESIZE - 1)
        return aligned, end - aligned

    @staticmethod
    def _populate(madvise: Madvise, addr: int, length: int) -> bool:
        """True when the kernel populated the range; False when it cannot (EINVAL: no
        MADV_POPULATE_WRITE), so the caller touches pages itself."""
        if madvise(addr, length, MADV_POPULATE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            logger.debug("KV prefault: madvise failed (%s)", errno.errorcode.get(err, err))
        return False

    def _run(self, madvise: Madvise, spans: list[tuple[int, int]]) -> None:
        t0 = time.monotonic()
        # The lowest priority, this thread alone (Linux nice is per thread): the engine's steps
        # come first, the pages fill in the time they leave.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            longest = max(size for _, size in spans)
            for offset in range(0, longest, ROUND_BYTES):
                for span in spans:
                    if offset < span[1]:
                        self._populate(madvise, *self._page(span, offset, ROUND_BYTES))
        except Exception:  # noqa: BLE001 - a page left lazy costs a fault later, nothing more
            logger.exception("KV prefault stopped early; the rest of the cache stays lazy")
        self.seconds = time.monotonic() - t0
        logger.info("KV cache's leading blocks resident after %.1f s (in the background)",
                    self.seconds)

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Until the leading blocks are resident."""
        if self._thread is not None:
            self._thread.join()
