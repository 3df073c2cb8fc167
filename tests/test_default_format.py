"""Which form of a packaged model an engine config serves (engine/kserve_paged_engine/frontend/startup.py): the default model
from its GGUF, 4-bit, when neither --dtype nor --quantization says otherwise; its dense float32
conversion for an explicit dtype. Config resolution only: nothing is converted or loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend import default_model, startup


@pytest.mark.parametrize(("kwargs", "device", "expected"), [
    ({}, "cpu", "gguf"),
    ({"dtype": "auto"}, "cpu", "gguf"),
    ({"model": default_model.DEFAULT_MODEL_ID}, "cpu", "gguf"),
    ({"dtype": "float32"}, "cpu", None),
    ({"dtype": "bfloat16"}, "cpu", None),
    ({"dtype": "float32", "quantization": "gguf"}, "cpu", "gguf"),
    ({"quantization": "int4"}, "cpu", "int4"),
    ({}, "cuda", None),
    ({"tensor_parallel_size": 2}, "cpu", "gguf"),  # each rank cuts the blocks
    ({"load_format": "dummy"}, "cpu", None),
    ({"model": "gemma3-270m"}, "cpu", None),
])
def test_packaged_quantization(kwargs: dict, device: str, expected: str | None) -> None:
    quantization, why = startup.packaged_quantization(EngineConfig(**kwargs), device)
    assert quantization == expected
    assert why  # the start-up log says why


@pytest.mark.parametrize(("kwargs", "gguf_folder", "quantization"), [
    ({}, True, "gguf"),
    ({"dtype": "float32"}, False, None),
    ({"dtype": "bfloat16", "quantization": "gguf"}, True, "gguf"),
])
def test_default_model_folder_follows_the_format(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kwargs: dict,
        gguf_folder: bool, quantization: str | None) -> None:
    calls: list[tuple[str, bool]] = []

    def fake_ensure(model_id: str, progress: object = None, gguf_folder: bool = False) -> Path:
        calls.append((model_id, gguf_folder))
        return Path(f"/cache/{model_id}{'-gguf' if gguf_folder else ''}")

    monkeypatch.setattr(default_model, "ensure_model", fake_ensure)
    caplog.set_level("INFO", logger="kserve_paged_engine")
    path, quant = startup.resolve_model(EngineConfig(**kwargs), "cpu")
    assert calls == [(default_model.DEFAULT_MODEL_ID, gguf_folder)]
    assert quant == quantization and path.endswith("-gguf") == gguf_folder
    assert f"model {default_model.DEFAULT_MODEL_ID}: " in caplog.text


def test_a_path_is_served_as_given(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path), quantization="int8")
    assert startup.resolve_model(config, "cpu") == (str(tmp_path), "int8")


@pytest.mark.parametrize(("requested", "quantization", "native_bf16", "expected"), [
    ("auto", "gguf", False, torch.float32),  # PyTorch's int4 kernel would take bf16: ours f32
    ("auto", "gguf", True, torch.bfloat16),  # a native kernel for auto's dtype: kept
    ("bfloat16", "gguf", False, torch.bfloat16),  # asked for: kept
    ("auto", None, False, torch.bfloat16),  # dense: auto's own
])
def test_auto_activations_of_a_4_bit_gguf(monkeypatch: pytest.MonkeyPatch, requested: str,
                                          quantization: str | None, native_bf16: bool,
                                          expected: torch.dtype) -> None:
    from kserve_paged_kernels import quant_linear

    monkeypatch.setattr(quant_linear, "native_for",
                        lambda dtype: dtype == torch.float32 or native_bf16)
    dtype, why = startup.gguf_activations(requested, torch.bfloat16, quantization, "cpu")
    assert dtype == expected and (why is not None) == (dtype != torch.bfloat16)
