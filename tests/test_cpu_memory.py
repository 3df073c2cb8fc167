"""kserve_paged_engine.worker.cpu_memory: huge-page KV storage, glibc tuning, re-exec with tcmalloc."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from kserve_paged_engine.worker.cpu_memory import (
    find_tcmalloc,
    hugepage_zeros,
    prefault_bytes,
    prefault_leading_blocks,
    tune_glibc_malloc,
)


@pytest.mark.parametrize("shape", [(3, 5), (2, 64, 16, 3, 64)])
def test_hugepage_zeros_is_a_writable_zero_tensor(shape: tuple[int, ...]) -> None:
    t = hugepage_zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.count_nonzero() == 0
    t.view(-1)[-1] = 3.0  # the last element is inside the allocation
    assert t.sum() == 3.0


def test_hugepage_zeros_large_tensor_is_zero_and_outlives_its_maker() -> None:
    t = hugepage_zeros((4, 1 << 20), torch.float32)[1:]  # 16 MiB, only a view kept
    assert t.count_nonzero() == 0
    t.fill_(2.0)
    assert t.sum() == 2.0 * 3 * (1 << 20)


def test_tune_glibc_malloc_runs_and_allocation_still_works() -> None:
    assert isinstance(tune_glibc_malloc(), bool)
    assert torch.ones(1 << 22).sum() == float(1 << 22)


_PROBE = ("from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc; reexec_with_tcmalloc(); "
          "print(any('tcmalloc' in line for line in open('/proc/self/maps')))")


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc are Linux")
def test_reexec_loads_tcmalloc_when_found_and_not_when_disabled() -> None:
    if find_tcmalloc() is None:
        pytest.skip("no tcmalloc here (scripts/setup.sh extracts one where apt-get works)")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    on = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                        timeout=120, check=True)
    assert on.stdout.strip() == "True"
    off = subprocess.run([sys.executable, "-c", _PROBE], env={**env, "KSERVE_PAGED_TCMALLOC": "0"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert off.stdout.strip() == "False"


# Runs `python -m kserve_paged` in-process with os.execve replaced: reports whether torch was
# already imported when the tcmalloc re-exec happened, then stops before anything else runs.
_EXEC_PROBE = """
import os, runpy, sys
def execve(path, argv, env):
    print("torch" in sys.modules, "tcmalloc" in env.get("LD_PRELOAD", ""))
    sys.stdout.flush()
    os._exit(0)
os.execve = execve
sys.argv = ["kserve_paged"]
runpy.run_module("kserve_paged", run_name="__main__", alter_sys=True)
print("no re-exec")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc are Linux")
def test_server_entry_point_reexecs_before_importing_torch(tmp_path) -> None:
    lib = tmp_path / "lib" / "libtcmalloc_minimal.so.4"  # found by find_tcmalloc if no other is
    lib.parent.mkdir()
    lib.write_bytes(b"")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "KSERVE_PAGED_TCMALLOC")}
    env["KSERVE_PAGED_CACHE"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _EXEC_PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr[-2000:]


@pytest.mark.skipif(sys.platform != "linux", reason="lazily zeroed mappings are Linux-only here")
def test_prefault_touches_the_leading_blocks_once_and_keeps_them_zero() -> None:
    # 12.6 MB each: large enough for the lazily zeroed huge-page mapping (not torch.zeros).
    caches = [hugepage_zeros((2, 512, 16, 3, 64), torch.float32) for _ in range(2)]
    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    before = faults()
    prefault_leading_blocks(caches, 128)
    first = faults() - before
    assert first > 0  # pages of blocks 0..127 (K and V halves) were mapped in
    before = faults()
    prefault_leading_blocks(caches, 128)
    assert faults() - before < first  # already resident: nothing left to fault
    assert all(c.count_nonzero() == 0 for c in caches)


def test_prefault_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSERVE_PAGED_KV_PREFAULT_MIB", "3")
    assert prefault_bytes() == 3 << 20
    monkeypatch.setenv("KSERVE_PAGED_KV_PREFAULT_MIB", "0")
    assert prefault_bytes() == 0
    monkeypatch.setenv("KSERVE_PAGED_KV_PREFAULT_MIB", "lots")
    with pytest.raises(ValueError, match="KSERVE_PAGED_KV_PREFAULT_MIB"):
        prefault_bytes()
