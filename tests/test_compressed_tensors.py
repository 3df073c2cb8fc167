"""compressed-tensors checkpoints (llm-compressor's format): W4A16 packed (symmetric and
asymmetric), W8A8 int8 per channel and FP8 per tensor, written from the format's definition
(tests/helpers/compressed_tensors_checkpoints.py) on a tiny random Llama, served as stored
where a layout here holds them, and checked against the same checkpoint dequantized into a
float folder."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.quantization import compressed_tensors  # noqa: E402
from kserve_paged_engine.model_executor.quantization.layouts import projections  # noqa: E402
from kserve_paged_kernels import int4_layouts, quant_linear  # noqa: E402
from tests.helpers.compressed_tensors_checkpoints import PROMPT, write  # noqa: E402
from tests.helpers.int4_packing import read_checkpoint  # noqa: E402
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint  # noqa: E402
from tests.kernels.interpreted import run_calls  # noqa: E402

CPU = torch.device("cpu")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedSim(model, seed=0).step([(0, PROMPT)])


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path_factory.mktemp("float"))
    return folder


@pytest.mark.parametrize(("scheme", "layout"), [
    ("w4a16", quant_linear.Int4Weight), ("w4a16_asym", quant_linear.Int4Weight),
    ("w8a8", quant_linear.Int8Weight), ("fp8", quant_linear.Fp8Weight)])
def test_checkpoint_served_as_stored_where_a_layout_holds_it(
        float_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, scheme: str,
        layout: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """W8A8 here as on a CPU without VNNI (weight-only; tests/test_w8a8.py runs the rest)."""
    monkeypatch.setattr(compressed_tensors, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    folder = write(float_checkpoint, tmp_path, scheme)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        kept, _ = load_model(folder, torch.float32, CPU)
    assert "quantization compressed-tensors (checkpoint)" in caplog.text
    assert ("activations (int 8 token): they stay float here (this CPU has no VNNI"
            in caplog.text) == (scheme == "w8a8")
    floats = dict(projections(reference))
    for name, linear in projections(kept):
        assert isinstance(linear.quant, layout), name
        served = linear.weight if linear.quant is None else quant_linear.dequant(linear.quant)
        torch.testing.assert_close(served, floats[name].weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(_logits(kept), _logits(reference), atol=1e-3, rtol=0)


@pytest.mark.parametrize(("scheme", "layout"), [("w4a16_asym", int4_layouts.CheckpointInt4Weight),
                                                ("fp8", quant_linear.Fp8Weight)])
def test_cuda_gets_the_stored_form_for_the_triton_gemms(
        float_checkpoint: Path, tmp_path: Path, scheme: str, layout: type) -> None:
    folder = write(float_checkpoint, tmp_path, scheme)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    reader = read_checkpoint(compressed_tensors.CTReader, compressed_tensors.read_config, folder)
    pick = reader.picker(torch.float32, triton=True)
    kept = {}
    for name, linear in projections(reference):
        _, weight = pick(name, linear)
        assert isinstance(weight, layout), name
        torch.testing.assert_close(quant_linear.dequant(weight), linear.weight, atol=1e-6,
                                   rtol=0)
        kept[name] = weight
    name = "model.layers.1.self_attn.qkv_proj"
    x = torch.randn(4, kept[name].in_features)
    ((got, _),) = run_calls([("kserve_paged_kernels.quant_linear", "matmul", (x, kept[name]), {})], tmp_path)
    torch.testing.assert_close(got, x @ dict(projections(reference))[name].weight.t(),
                               atol=1e-4, rtol=1e-5)


def test_schemes_not_served_fail_before_loading(float_checkpoint: Path, tmp_path: Path) -> None:
    folder = write(float_checkpoint, tmp_path, "w4a16")
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    bad = [({"format": "marlin-24"}, "format 'marlin-24' is not served"),
           ({"quantization_status": "frozen"}, "only compressed ones"),
           ({"config_groups": {"g": {"weights": {"num_bits": 2}}}}, "only 4-bit")]
    for change, says in bad:
        (folder / "config.json").write_text(json.dumps(
            config | {"quantization_config": qc | change}))
        with pytest.raises(ValueError, match=says):
            load_model(folder, torch.float32, CPU)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with compressed-tensors .* 'awq' was asked"):
        load_model(folder, torch.float32, CPU, quantization="awq")
