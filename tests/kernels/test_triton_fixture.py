"""The Triton-interpreter setup (tests/helpers/triton.py) leaves nothing behind: after a test
module's kernels ran in the interpreter, TRITON_INTERPRET and the module table are as they
were, so no other test sees the interpreter."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.triton import TritonKernels

MODULE = "kserve_paged_kernels.block_copy_triton"


def test_the_interpreter_is_set_for_its_tests_and_restored_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = sys.modules.get(MODULE)
    kernels = TritonKernels()
    try:
        module = kernels.load(MODULE)
        if kernels.interpret:
            assert os.environ["TRITON_INTERPRET"] == "1"
            assert type(module._copy_blocks_kernel).__name__ == "InterpretedFunction"
            assert module is not before
    finally:
        kernels.close()
    assert "TRITON_INTERPRET" not in os.environ
    assert sys.modules.get(MODULE) is before
