"""The CUDA copy-on-write block copy (kernels/block_copy_triton.py) against the block-by-block
reference, in Triton's interpreter without CUDA (TRITON_INTERPRET set before the kernel is
defined, as in test_triton_backend.py)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401

    import kernels.block_copy_triton as bct

    if not HAS_CUDA and type(bct._copy_blocks_kernel).__name__ != "InterpretedFunction":
        bct = importlib.reload(bct)
    SKIP_REASON = None
except Exception as exc:  # triton missing or broken on this host
    SKIP_REASON = f"Triton cannot run here: {type(exc).__name__}: {exc}"

from kernels.block_copy import copy_blocks_ref  # noqa: E402

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 10, 4, 2, 8), (2, 6, 16, 3, 64)],
                         ids=["small-block", "default-model-block"])
def test_triton_block_copy_matches_the_reference(shape, dtype):
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    expect = [c.clone() for c in caches]
    src, dst = [1, 4, 3], [2, 0, 5]
    bct.copy_blocks_triton(caches, torch.tensor(src, device=DEVICE),
                           torch.tensor(dst, device=DEVICE))
    copy_blocks_ref(expect, src, dst)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
