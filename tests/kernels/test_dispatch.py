"""Backend selection: keyword > env var > device default; clear errors; logged once."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kserve_paged_kernels.dispatch
from kserve_paged_kernels import ENV_VAR, paged_attention, resolve_backend


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(kserve_paged_kernels.dispatch, "_logged", set())


def test_cpu_default_is_the_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("cpu") == "cpu"
    assert resolve_backend(torch.device("cpu"), block_size=16, head_dim=64) == "cpu"


def test_env_var_overrides_default_and_keyword_overrides_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend("cpu") == "triton"
    assert resolve_backend("cpu", "torch") == "cpu"
    monkeypatch.setenv(ENV_VAR, " Torch ")
    assert resolve_backend("cpu") == "cpu"


@pytest.mark.parametrize("name", ["cuda", "flash-attention", "xformers"])
def test_invalid_name_is_a_clear_value_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    with pytest.raises(ValueError, match="expected one of cpu, triton, flash_attn"):
        resolve_backend("cpu", name)
    monkeypatch.setenv(ENV_VAR, name)
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend("cpu")
    case_q = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="unknown paged-attention backend"):
        paged_attention(case_q, torch.zeros(2, 1, 16, 1, 64), torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                        0.125)


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("cpu", "triton")


def test_flash_attn_off_cuda_falls_back_with_logged_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.INFO, logger="kserve_paged_kernels"):
        assert resolve_backend("cpu", "flash_attn", block_size=16) == "triton"
    assert any("flash_attn needs CUDA" in r.getMessage() for r in caplog.records)


def test_flash_attn_block_size_rule() -> None:
    from kserve_paged_kernels.flash_attn_backend import unusable_reason

    cuda = torch.device("cuda")
    why = unusable_reason(cuda, 16, 128, torch.bfloat16)
    assert why is not None  # not importable here, or block size 16 rejected
    if "does not import" not in why:
        assert "256" in why
        assert unusable_reason(cuda, 256, 128, torch.bfloat16) is None


def test_choice_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kserve_paged_kernels"):
        for _ in range(3):
            resolve_backend("cpu")
    msgs = [r.getMessage() for r in caplog.records if r.name == "kserve_paged_kernels"]
    assert msgs == ["paged-attention backend: cpu (device cpu, default)"]


def test_import_pulls_neither_engine_nor_triton() -> None:
    code = ("import sys, kserve_paged_kernels; "
            "assert 'kserve_paged_engine' not in sys.modules, 'kserve_paged_engine'; "
            "assert 'triton' not in sys.modules, 'triton'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
