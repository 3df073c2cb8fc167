"""Fixtures every test file may use (helpers to import are in tests/helpers/)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.triton import TritonKernels, prepare_interpreter

prepare_interpreter()  # before any test module imports torch's compiler (which imports Triton)


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[TritonKernels]:
    """`triton_interpreter.load("kernels.x")`: the module with runnable Triton kernels (in the
    interpreter without CUDA) for this test module's tests; TRITON_INTERPRET and the module
    table are restored after them."""
    kernels = TritonKernels()
    try:
        yield kernels
    finally:
        kernels.close()
