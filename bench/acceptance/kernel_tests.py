"""The acceptance run's pytest stages: the kernel tests that mean something on CUDA, run by a
pytest carried in this tree, in shards side by side, each test's outcome recorded as it ends.

Why a carried pytest: the GPU image may have none (and then the stage failed in a second, its
tests unrun), or one whose plugins do not fit ours. `wheels/` holds pytest and the pure-Python
packages it imports, hash-pinned below; the stage unpacks them once into the Triton cache
folder and puts them first on its children's PYTHONPATH, with the image's plugins kept out
(PYTEST_DISABLE_PLUGIN_AUTOLOAD). A hand-written runner was the other way: the tests lean on
fixtures (module-scoped, tmp_path, conftest's), parametrize ids, skipif and importorskip, so it
would be a second pytest to keep in step with the first. To refresh the wheels:
`pip download --no-deps --only-binary :all: --python-version 3.12 -d bench/acceptance/wheels
pytest pluggy iniconfig packaging pygments`, then the hashes below (`sha256sum`).

Why shards: on a cold Triton cache the stage's time is compiles, one at a time in a process;
N processes sharing one TRITON_CACHE_DIR compile N at once (Triton writes its cache entries
atomically, so they can share it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from acceptance.runner import Context, Part

HERE = Path(__file__).resolve().parent
WHEEL_DIR = HERE / "wheels"
PLUGIN_DIR = HERE / "pytest_plugin"
PLUGIN = "acceptance_record"  # the module in PLUGIN_DIR
WHEELS = {  # file name -> sha256
    "pytest-9.2.0-py3-none-any.whl":
        "07acdcf88ec174f907dc01af70bf52d49b014bbab03faeeade31c96b18c2e588",
    "pluggy-1.7.0-py3-none-any.whl":
        "7dd7b0d8832ba3cb632c306926ded123429211b83641b35dc5c41ad2d34f9bec",
    "iniconfig-2.3.1-py3-none-any.whl":
        "9121e2c1fdb355232495be3194c8dfe87ccc2d5dee45947b78e68f499790d7a7",
    "packaging-26.4-py3-none-any.whl":
        "81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2",
    "pygments-2.21.0-py3-none-any.whl":
        "2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9",
}

KERNEL_TESTS = [
    "tests/kernels/test_triton_backend.py",  # attention + KV store vs reference (grid apart)
    "tests/kernels/test_fused_triton.py",  # add + RMSNorm, RoPE + store, act-and-mul
    "tests/kernels/test_block_copy_triton.py",
    "tests/kernels/test_kv_quant_triton.py",  # the quantized KV store vs the PyTorch store
    "tests/kernels/test_quant_gemm_triton.py",  # AWQ/GPTQ int4 and fp8 GEMMs vs dequantized
    "tests/kernels/test_triton_api.py",  # the image's Triton has what our code uses
    "tests/test_supported_versions.py",  # the image's versions inside pyproject's ranges
]
GRID_TESTS = ["tests/kernels/test_triton_backend.py"]  # its `gpu_grid` tests, run apart
# A module-scoped fixture computes every test's result in one child: one shard runs the file.
WHOLE_FILES = ["tests/kernels/test_fused_triton.py"]
LEFT_OUT = {
    "tests/kernels/test_triton_compile.py": "sm_90 compiles for a host without a GPU, each in "
    "a child with an empty Triton cache: the CPU suite runs them, and on the GPU the stage's "
    "own launches compile the kernels for real",
    "tests/kernels/test_moe_triton.py": "passes CPU tensors to compiled kernels (issue 32)",
    "tests/kernels/test_lora_triton.py": "fp32 cases meet TF32 dots with atol 1e-4 (issue 32)",
    "tests/kernels/test_cpu_*.py, test_gemm, test_isa, test_lora_native, test_native_abi, "
    "test_decoder_stack": "the native CPU kernels (they need gcc, and are not the GPU path)",
}
# The dry run's taste of the same files: the static checks and one interpreted attention case.
DRY_RUN_TESTS = ["tests/kernels/test_triton_api.py", "tests/test_supported_versions.py",
                 "tests/kernels/test_triton_backend.py::test_dispatch_and_padding_tokens"]
MAX_SHARDS = 8


def shard_count(dry_run: bool) -> int:
    """Shards for this machine: half its cores (each compile is one core; the other half
    runs LLVM's and ptxas's children and the tests' own), at most MAX_SHARDS; two in the dry
    run, enough to check the plumbing."""
    return 2 if dry_run else max(1, min(MAX_SHARDS, (os.cpu_count() or 2) // 2))


def vendored_pytest(cache_dir: Path) -> Path:
    """The folder holding the wheels' packages, unpacked once under `cache_dir`; raises when a
    wheel is missing or not the pinned one."""
    digest = hashlib.sha256("".join(sorted(WHEELS.values())).encode()).hexdigest()[:12]
    target = cache_dir / f"pytest-{digest}"
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="pytest-", dir=cache_dir))
    try:
        for name, sha in WHEELS.items():
            wheel = WHEEL_DIR / name
            if not wheel.is_file():
                raise FileNotFoundError(f"{wheel} is missing: the stage's pytest comes from it")
            if hashlib.sha256(wheel.read_bytes()).hexdigest() != sha:
                raise ValueError(f"{wheel} is not the pinned wheel (sha256 differs)")
            with zipfile.ZipFile(wheel) as z:
                z.extractall(staging)
        staging.rename(target)
    except OSError:
        if not target.is_dir():  # not another run unpacking it first: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def pytest_parts(ctx: Context, folder: Path, targets: list[str], marks: str | None,
                 shards: int, prefix: str = "shard") -> list[Part]:
    """One part per shard, `{prefix}-{k}`: `python -m pytest` over `targets` (the carried
    pytest, our plugin, no other), `-m marks` when given, each recording its tests to its own
    file."""
    env = {"PYTHONPATH": os.pathsep.join([str(vendored_pytest(ctx.cache_dir)), str(PLUGIN_DIR)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    parts = []
    for k in range(shards):
        record = folder / f"{prefix}-{k}.jsonl"
        record.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "-ra", "--strict-markers", "-p", PLUGIN, "--acceptance-record", str(record),
               "--acceptance-shard", f"{k}/{shards}"]
        for path in WHOLE_FILES:
            cmd += ["--acceptance-whole", path]
        if marks:
            cmd += ["-m", marks]
        # 5: pytest's exit status when a shard got no test (fewer tests than shards)
        parts.append(Part(f"{prefix}-{k}", cmd + targets, env=env, record=record,
                          progress=recorded_outcomes, ok_codes=(0, 5)))
    return parts


def recorded_outcomes(record: Path | None, text: str) -> dict[str, Any]:
    """Each test's latest record from the plugin's file: its outcome ("running" while it
    runs), and its seconds and why it failed once it ended."""
    if record is None or not record.is_file():
        return {}
    tests: dict[str, Any] = {}
    for line in record.read_text().splitlines():
        try:
            fields = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        tests[fields.pop("test")] = fields
    return tests
