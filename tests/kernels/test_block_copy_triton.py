"""The CUDA copy-on-write block copy (kernels/kserve_paged_kernels/block_copy_triton.py) against the block-by-block
reference, in Triton's interpreter without CUDA (the `triton_interpreter` fixture)."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels.block_copy import copy_blocks_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("bct")  # every test runs with the kernels loadable


@pytest.fixture(scope="module")
def bct(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.block_copy_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 10, 4, 2, 8), (2, 6, 16, 3, 64)],
                         ids=["small-block", "default-model-block"])
def test_triton_block_copy_matches_the_reference(bct, shape, dtype):
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    expect = [c.clone() for c in caches]
    src, dst = [1, 4, 3], [2, 0, 5]
    bct.copy_blocks_triton(caches, torch.tensor(src, device=DEVICE),
                           torch.tensor(dst, device=DEVICE))
    copy_blocks_ref(expect, src, dst)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
