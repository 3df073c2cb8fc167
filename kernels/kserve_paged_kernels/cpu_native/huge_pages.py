"""Host memory on transparent huge pages, for what every step streams from DRAM.

Why: a decode step reads every packed weight once, and the weights do not stay in cache from
one step to the next. On 4 KiB pages that read takes a TLB miss every 4 KiB, and the hardware
prefetchers stop at each page's end; on 2 MiB pages the weight-bound products (decode with few
rows, one request at a time) read faster (bench/probes/weight_pages.py, BENCHMARKS.md).

- `mapping_tensor(nbytes)`: a zero uint8 tensor on an anonymous mapping of its own, advised as
  huge pages and aligned to one, zeroed lazily by the OS (the KV cache's storage).
- `on_huge_pages(t)`: a copy of `t` in the weight arena. A layer's packed projections are a few
  MiB each, less than a huge page apart, so each taking a mapping of its own would round every
  one up to whole huge pages; the arena puts them one after another in shared chunks. A chunk
  is unmapped when the last tensor in it is gone (each tensor keeps its chunk alive), but the
  space of one tensor that goes is not reused: a pack that is only a step toward another (a
  projection the MLP fuses, an expert before its layer's stack) is made off the arena.
Off Linux, or where the kernel refuses the advice, the same memory on ordinary pages.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
ARENA_CHUNK = 32 << 20  # bytes a chunk of the weight arena maps; a larger tensor gets its own
ALIGN = 256  # bytes between the starts of tensors in a chunk: whole cache lines, vector-aligned


def mapping_tensor(nbytes: int) -> torch.Tensor:
    """A zero uint8 tensor of `nbytes` on a fresh anonymous mapping whose start is aligned to a
    huge page, advised MADV_HUGEPAGE (Linux); nothing is written, so no page is touched yet."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if sys.platform == "linux":
        with contextlib.suppress(AttributeError, OSError):  # THP off, an old kernel: 4 KiB pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps the mapping alive as long as the tensor (and every view of it) lives.
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


class _Arena:
    """The chunk being filled and how much of it is used."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chunk: torch.Tensor | None = None
        self.used = 0
        self.taken = 0  # bytes handed out since the process began

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            self.taken += nbytes
            if nbytes > ARENA_CHUNK // 2:
                return mapping_tensor(nbytes)
            start = -(-self.used // ALIGN) * ALIGN
            if self.chunk is None or start + nbytes > ARENA_CHUNK:
                self.chunk, start = mapping_tensor(ARENA_CHUNK), 0
            self.used = start + nbytes
            return self.chunk[start:start + nbytes]


_ARENA = _Arena()


def arena_taken() -> int:
    """Bytes the weight arena has handed out in this process: a count that only grows, since
    space in a chunk is never reused."""
    return _ARENA.taken


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` (same shape and dtype) in the weight arena."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes == 0 or sys.platform != "linux":
        return t.contiguous()
    out = _ARENA.take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
