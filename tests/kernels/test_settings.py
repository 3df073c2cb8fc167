"""kserve_paged_kernels.settings: the one place `KSERVE_PAGED_*` variables are read, lazily."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kserve_paged_kernels import settings
from tests.helpers.layout import REPO, python_files


def _sources() -> list[Path]:
    return python_files()


def test_every_variable_named_in_the_packages_is_a_setting() -> None:
    known = {var.name for var in settings.ALL}
    named = {m for p in _sources() for m in re.findall(r"KSERVE_PAGED_[A-Z0-9_]+", p.read_text())}
    assert named <= known, f"not in kernels/kserve_paged_kernels/settings.py: {sorted(named - known)}"
    assert all(var.doc for var in settings.ALL)


def test_only_the_settings_module_reads_the_environment_for_them() -> None:
    reads = re.compile(r"(environ\.get|getenv|environ\[)\(?\s*[\"']KSERVE_PAGED_")
    offenders = [str(p.relative_to(REPO)) for p in _sources()
                 if p.name != "settings.py" and reads.search(p.read_text())]
    assert offenders == []


def test_flags_and_integers_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KSERVE_PAGED_NATIVE", raising=False)
    assert settings.native_enabled()
    for off in ("0", " false ", "No"):
        monkeypatch.setenv("KSERVE_PAGED_NATIVE", off)
        assert not settings.native_enabled()
    monkeypatch.setenv("KSERVE_PAGED_NATIVE", "1")
    assert settings.native_enabled()
    monkeypatch.setenv("KSERVE_PAGED_TORCH_DECODE_BUDGET", "512")
    assert settings.torch_decode_budget() == 512
    monkeypatch.setenv("KSERVE_PAGED_TORCH_DECODE_BUDGET", "many")
    with pytest.raises(ValueError, match="KSERVE_PAGED_TORCH_DECODE_BUDGET"):
        settings.torch_decode_budget()


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KSERVE_PAGED_CACHE", str(tmp_path))
    assert settings.cache_dir() == tmp_path
    monkeypatch.delenv("KSERVE_PAGED_CACHE")
    assert settings.cache_dir() == Path.home() / ".cache" / "kserve-paged"


def test_settings_and_cpu_memory_import_without_torch() -> None:
    code = ("import sys, kserve_paged_kernels.settings, kserve_paged_engine.worker.cpu_memory; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"
