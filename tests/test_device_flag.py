"""--device naming a device this machine lacks is refused where the engine's options are
checked (EngineConfig), before any weight loads: the server exits with a usage error, the
offline LLM raises ValueError, both in our words rather than torch's from deep in loading.

torch.cuda is monkeypatched so the tests mean the same on a GPU machine; the stand-in CUDA
device (tests/helpers/standin_cuda_api.py) patches the same `torch.cuda.is_available`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged import args as server_args
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.core.kv_sizing import resolve_device

NO_CUDA = r"--device cuda: no CUDA device is available here \(torch.cuda.is_available\(\) is False\)"


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stand-in CUDA device answers (one device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_the_server_flag_exits_with_a_usage_error_that_says_why(no_gpu: None,
                                                                 capsys: pytest.CaptureFixture
                                                                 ) -> None:
    with pytest.raises(SystemExit) as exc:
        server_args.parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: --device cuda: no CUDA device is available here" in err
    assert "use --device cpu" in err


def test_the_server_exits_before_it_serves(no_gpu: None, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """server.main: the refusal comes from its argument parsing, before the model is built."""
    from kserve_paged import server

    def serve(*args: object) -> None:
        raise AssertionError("the server went on to build the engine")

    monkeypatch.setattr(server, "serve", serve)
    with pytest.raises(SystemExit) as exc:
        server.main(["--device", "cuda", "--model_dir", "/nonexistent"])
    assert exc.value.code == 2 and "no CUDA device is available here" in capsys.readouterr().err


def test_the_offline_llm_raises_before_it_looks_for_the_model(no_gpu: None,
                                                              tmp_path: Path) -> None:
    """A model folder that does not exist: the device is refused first, so nothing loaded."""
    from kserve_paged_engine import LLM

    with pytest.raises(ValueError, match=NO_CUDA):
        LLM(model=str(tmp_path / "absent"), device="cuda")
    with pytest.raises(ValueError, match="--device cuda:0: no CUDA device is available here"):
        EngineConfig(device="cuda:0")


def test_auto_and_cpu_still_mean_cpu_here(no_gpu: None) -> None:
    for device in ("auto", "cpu"):
        assert EngineConfig(device=device).device == device
        assert resolve_device(device).type == "cpu"
    assert server_args.parse_args(["--device", "auto"]).device == "auto"


def test_where_cuda_answers_cuda_is_accepted(one_gpu: None) -> None:
    assert server_args.parse_args(["--device", "cuda"]).device == "cuda"
    assert EngineConfig(device="cuda:0").device == "cuda:0"
    with pytest.raises(ValueError, match=r"--device cuda:1: 1 CUDA device\(s\) visible"):
        EngineConfig(device="cuda:1")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "mps"])
def test_a_device_the_engine_does_not_run_on_is_named(device: str) -> None:
    with pytest.raises(ValueError, match=f"--device '{device}' must be one of auto, cpu, cuda"):
        EngineConfig(device=device)


def test_the_standin_cuda_device_counts_as_cuda() -> None:
    """The check asks torch.cuda when it runs, so the tests' stand-in CUDA device (which
    patches torch.cuda) passes it: LLM(device="cuda") under it reaches the engine."""
    from tests.helpers.standin_cuda import StandinCuda
    from tests.helpers.standin_cuda_api import require_standin

    require_standin()
    with StandinCuda():
        assert EngineConfig(device="cuda").device == "cuda"
    with pytest.raises(ValueError, match="no CUDA device is available here"):
        EngineConfig(device="cuda")  # the stand-in gone: this machine again
