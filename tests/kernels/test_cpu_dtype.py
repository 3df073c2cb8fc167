"""`--dtype auto` on CPU (kernels/kserve_paged_kernels/cpu_dtype.py, through engine/kserve_paged_engine/core/kv_sizing.resolve_dtype):
bfloat16 where the CPU has native bf16, float32 where bf16 would be emulated, checked for
every machine type seen with its flags stubbed; CUDA's `auto` is the checkpoint's dtype."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kserve_paged_engine.core.kv_sizing import checkpoint_dtype, resolve_dtype
from kserve_paged_engine.frontend import startup
from kserve_paged_kernels import cpu_dtype
from kserve_paged_kernels.cpu_native import isa
from tests.helpers.cpu_flags import MACHINES

AUTO = {  # machine type -> what `auto` must be there, and why
    "AMD EPYC Zen 3": torch.float32,  # AVX2 only: bf16 emulated
    "Intel Xeon Ice Lake": torch.float32,  # AVX-512 without BF16: emulated
    "Intel Xeon with AVX512-BF16, no AMX": torch.bfloat16,  # the BF16 dot products
    "Intel Xeon Sapphire Rapids (AMX)": torch.bfloat16,  # AMX tiles and AVX512-BF16
}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _rule_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KSERVE_PAGED_CPU_AUTO_DTYPE", raising=False)  # tests/conftest.py pins it


def test_every_machine_type_seen_has_a_rule() -> None:
    assert set(AUTO) == set(MACHINES)


@pytest.mark.parametrize("machine", sorted(AUTO))
def test_auto_on_cpu_follows_native_bf16(machine: str) -> None:
    flags = frozenset(MACHINES[machine][0].split())
    assert cpu_dtype.cpu_auto_dtype(flags) == AUTO[machine]
    assert resolve_dtype("auto", CPU, cpu_flags=flags) == AUTO[machine]
    # An explicit dtype is never second-guessed, and the checkpoint does not matter on CPU.
    assert resolve_dtype("float32", CPU, cpu_flags=flags) == torch.float32
    assert resolve_dtype("bfloat16", CPU, "float32", cpu_flags=flags) == torch.bfloat16
    assert resolve_dtype("auto", CPU, "float32", cpu_flags=flags) == AUTO[machine]
    assert cpu_dtype.describe(flags).startswith(
        "native bf16" if AUTO[machine] == torch.bfloat16 else "no avx512_bf16")


def test_either_bf16_flag_alone_counts_as_native() -> None:
    assert cpu_dtype.cpu_auto_dtype({"avx2", "amx_bf16"}) == torch.bfloat16
    assert cpu_dtype.cpu_auto_dtype({"avx512f", "avx512_bf16"}) == torch.bfloat16
    assert cpu_dtype.cpu_auto_dtype(set()) == torch.float32


@pytest.mark.parametrize("ckpt, expected", [
    ("float32", torch.bfloat16), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
    (None, torch.bfloat16)])
def test_auto_on_cuda_is_the_checkpoints_dtype(ckpt: str | None, expected: torch.dtype) -> None:
    # vLLM's rule: the checkpoint's dtype, float32 checkpoints served in bfloat16. The CPU's
    # flags play no part.
    for flags in (frozenset(), frozenset({"amx_bf16"})):
        assert resolve_dtype("auto", torch.device("cuda"), ckpt, cpu_flags=flags) == expected


def test_the_environment_pins_the_cpu_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    amx = frozenset(MACHINES["Intel Xeon Sapphire Rapids (AMX)"][0].split())
    monkeypatch.setenv("KSERVE_PAGED_CPU_AUTO_DTYPE", "float32")
    assert resolve_dtype("auto", CPU, cpu_flags=amx) == torch.float32
    monkeypatch.setenv("KSERVE_PAGED_CPU_AUTO_DTYPE", "bfloat16")
    assert resolve_dtype("auto", CPU, cpu_flags=frozenset()) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), "float16") == torch.float16  # CPU only
    monkeypatch.setenv("KSERVE_PAGED_CPU_AUTO_DTYPE", "half")
    with pytest.raises(ValueError, match="must be float32 or bfloat16"):
        resolve_dtype("auto", CPU)


def test_checkpoint_dtype_reads_config_json(tmp_path: Path) -> None:
    assert checkpoint_dtype(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16",
                                                      "torch_dtype": "float32"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"  # transformers 5's key first
    assert checkpoint_dtype(tmp_path / "model.gguf") is None
    assert checkpoint_dtype(None) is None


def test_start_up_logs_the_choice_and_the_kernels(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    spr = frozenset(MACHINES["Intel Xeon Sapphire Rapids (AMX)"][0].split())
    monkeypatch.setattr(isa, "cpu_flags", lambda: spr)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        startup.log_dtype("auto", torch.bfloat16, CPU)
    text = caplog.text
    assert "dtype auto -> bfloat16 (native bf16 on this CPU: amx_bf16, avx512_bf16)" in text
    assert "CPU kernels for bfloat16:" in text and "attention:" in text
