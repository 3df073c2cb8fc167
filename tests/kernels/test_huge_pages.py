"""cpu_native.huge_pages: the weight arena and the huge-page mappings packed weights live on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native.huge_pages import (
    ALIGN,
    ARENA_CHUNK,
    HUGE_PAGE,
    mapping_tensor,
    on_huge_pages,
)

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_usable() -> bool:
    """THP in `always` or `madvise` mode (the selected mode is the one in brackets)."""
    return (sys.platform == "linux" and _THP.exists()
            and "[never]" not in _THP.read_text())


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    current, found = None, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and line.startswith("AnonHugePages:"):
            found += int(line.split()[1])
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.uint8])
def test_a_copy_equals_its_source_and_is_its_own_memory(dtype: torch.dtype) -> None:
    src = (torch.arange(3 * 40 * 7) % 251).to(dtype).view(3, 40, 7).transpose(1, 2)
    out = on_huge_pages(src)
    assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, src)
    out.zero_()  # a copy: the source keeps its values
    assert src.count_nonzero() > 0


def test_copies_in_the_arena_are_aligned_and_never_overlap() -> None:
    tensors = [on_huge_pages(torch.full((n,), float(i))) for i, n in enumerate((5, 1000, 77, 4096))]
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in tensors)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert all(bool((t == float(i)).all()) for i, t in enumerate(tensors))


def test_a_tensor_past_half_a_chunk_gets_a_mapping_of_its_own() -> None:
    big = on_huge_pages(torch.ones(ARENA_CHUNK // 4))  # a whole chunk's bytes
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == ARENA_CHUNK // 4
    assert float(big.sum()) == ARENA_CHUNK // 4


def test_a_mapping_starts_on_a_huge_page_and_is_zero() -> None:
    t = mapping_tensor(3 * HUGE_PAGE + 5)
    assert t.data_ptr() % HUGE_PAGE == 0 and t.numel() == 3 * HUGE_PAGE + 5
    assert t.count_nonzero() == 0


@pytest.mark.skipif(not _thp_usable(), reason="transparent huge pages are off here")
def test_a_packed_weight_is_backed_by_huge_pages() -> None:
    """The point of the module: a decode step's weight reads go through 2 MiB pages."""
    if not cpu_native.gemm_available():
        pytest.skip("the native library is not loaded")
    w = torch.randn(4096, 576)  # 9 MiB packed: whole huge pages inside it
    packed = cpu_native.pack_gemm_weight(w)
    assert _huge_kib(packed.data_ptr()) >= HUGE_PAGE // 1024
    x = torch.randn(3, 576)
    torch.testing.assert_close(cpu_native.gemm(x, packed, 4096), x @ w.T, rtol=1e-4, atol=1e-4)
