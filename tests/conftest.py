"""Fixtures every test file may use (helpers to import are in tests/helpers/)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.gpu_path_worker import GpuPathWorker
from tests.helpers.served_options import model_dir, ref, served  # noqa: F401 - fixtures
from tests.helpers.triton import TritonKernels, prepare_interpreter

prepare_interpreter()  # before any test module imports torch's compiler (which imports Triton)

# The suite's engines (and the servers it starts) run `--dtype auto` as float32 on every machine
# type, so a test means the same on a CPU with native bf16 (where auto is bfloat16) as on one
# without; tests/kernels/test_cpu_dtype.py checks the rule itself, with this unset.
os.environ.setdefault("KSERVE_PAGED_CPU_AUTO_DTYPE", "float32")

# Slow tests marked by name rather than in their file: each builds the native library again at
# another instruction-set level (minutes on two cores).
SLOW_BY_NAME = frozenset({
    "tests/kernels/test_isa.py::test_every_level_compiles_without_warnings_and_says_what_it_holds",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_BY_NAME:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[TritonKernels]:
    """`triton_interpreter.load("kserve_paged_kernels.x")`: the module with runnable Triton kernels (in the
    interpreter without CUDA) for this test module's tests; TRITON_INTERPRET and the module
    table are restored after them."""
    kernels = TritonKernels()
    try:
        yield kernels
    finally:
        kernels.close()


@pytest.fixture(scope="session")
def gpu_path() -> Iterator[GpuPathWorker]:
    """`gpu_path.call("host_syncs", "run", cases=[...])`: a bench script's function run on the
    GPU path (the Triton backend, interpreted without CUDA) in the session's one child process
    (tests/helpers/gpu_path_worker.py); skips without transformers or Triton."""
    import importlib.util

    pytest.importorskip("transformers")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    worker = GpuPathWorker()
    try:
        yield worker
    finally:
        worker.close()
