"""vLLM's `fp8` method: fp8 checkpoints written here from the format's definition (e4m3 codes,
`weight_scale` per tensor, or `weight_block_size` with `weight_scale_inv` per block; static
`input_scale`s; an `ignored_layers` projection stored float) on a tiny random Llama, against
the same checkpoint dequantized into a float folder; and `--quantization fp8` on a float
checkpoint, close to the float model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kserve_paged.args import parse_args
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.quantization import fp8_checkpoints
from kserve_paged_engine.model_executor.quantization.layouts import projections
from kserve_paged_kernels import quant_linear
from tests.helpers.int4_packing import read_checkpoint
from tests.helpers.quantized_checkpoints import IGNORED, SCHEMES
from tests.helpers.quantized_checkpoints import write_fp8 as write
from tests.helpers.tiny_models import CONFIGS, PagedSim, greedy, save_checkpoint
from tests.kernels.interpreted import run_calls

CPU = torch.device("cpu")
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23]
@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path_factory.mktemp("float"))[0]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedSim(model, seed=0).step([(0, PROMPT)])


def _served(linear: torch.nn.Module) -> torch.Tensor:
    return linear.weight if linear.quant is None else quant_linear.dequant(linear.quant)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_checkpoint_on_cpu_keeps_one_byte_codes(
        float_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        scheme: str) -> None:
    """float32: the codes on our native kernel (every level builds it); the weights it reads
    back are the dequantized float folder's and the logits agree."""
    folder = write(float_checkpoint, tmp_path, scheme)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        served, _ = load_model(folder, torch.float32, CPU)
    assert "quantization fp8 (checkpoint)" in caplog.text
    assert "fp8 e4m3 (one byte) [native kernel]" in caplog.text
    assert ("static input scales are not used" in caplog.text) == (scheme == "tensor_static")
    floats = dict(projections(reference))
    for name, linear in projections(served):
        assert isinstance(linear.quant, quant_linear.Fp8Weight) == (name != IGNORED), name
        torch.testing.assert_close(_served(linear), floats[name].weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(_logits(served), _logits(reference), atol=1e-4, rtol=0)
    assert served.native_stack is not None  # the one-call stack takes e4m3 projections ...
    stacked = _logits(served)
    served.use_native_stack = False  # ... bit for bit as the per-layer modules
    assert torch.equal(stacked, _logits(served))


def test_bf16_activations_get_the_dequantized_weights(
        float_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = write(float_checkpoint, tmp_path, "blocks")
    reference, _ = load_model(folder / "float", torch.bfloat16, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        served, _ = load_model(folder, torch.bfloat16, CPU)
    assert "bfloat16 (fp8, dequantized at load: the native e4m3 kernel takes float32" in (
        caplog.text)
    floats = dict(projections(reference))
    for name, linear in projections(served):
        assert linear.quant is None and torch.equal(linear.weight, floats[name].weight), name


def test_cuda_gets_the_codes_for_the_triton_gemm(float_checkpoint: Path, tmp_path: Path
                                                  ) -> None:
    """Block scales (per-row ones take the same `Fp8Weight` path as compressed-tensors' fp8,
    tests/test_compressed_tensors.py)."""
    folder = write(float_checkpoint, tmp_path, "blocks")
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    reader = read_checkpoint(fp8_checkpoints.Fp8Reader, fp8_checkpoints.read_config, folder)
    pick = reader.picker(torch.float32, triton=True)
    kept = {}
    for name, linear in projections(reference):
        _, weight = pick(name, linear)
        assert isinstance(weight, quant_linear.Fp8Weight) == (not name.startswith(IGNORED))
        if weight is not None:
            assert weight.block == (32, 32)
            torch.testing.assert_close(quant_linear.dequant(weight), linear.weight, atol=1e-6,
                                       rtol=0)
            kept[name] = weight
    name = "model.layers.1.self_attn.qkv_proj"
    x = torch.randn(4, kept[name].in_features)
    ((got, _),) = run_calls([("kserve_paged_kernels.quant_linear", "matmul", (x, kept[name]), {})], tmp_path)
    torch.testing.assert_close(got, x @ dict(projections(reference))[name].weight.t(),
                               atol=1e-4, rtol=1e-5)


def test_on_the_fly_fp8_is_close_to_float(float_checkpoint: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Each weight is its e4m3 value (3 mantissa bits: within 1/16 of itself, or of the
    scale's subnormal step); greedy tokens as the float model's over 8 steps; the prompt's
    logits move by up to 8.5% of the largest here (bound 12%)."""
    assert parse_args(["--quantization", "fp8"]).quantization == "fp8"
    reference, _ = load_model(float_checkpoint, torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        served, _ = load_model(float_checkpoint, torch.float32, CPU, quantization="fp8")
    assert "fp8 per tensor e4m3 (one byte) [native kernel]" in caplog.text
    floats = dict(projections(reference))
    for name, linear in projections(served):
        w, got = floats[name].weight, _served(linear)
        step = w.abs().amax() / 448 * 2**-9  # e4m3's smallest subnormal at this scale
        assert ((got - w).abs() <= w.abs() / 16 + step).all(), name
        assert not torch.equal(got, w)
    tokens, rows = greedy(served, PROMPT, 8)
    want, want_rows = greedy(reference, PROMPT, 8)
    assert tokens == want
    bound = 0.12 * float(want_rows[0].abs().max())
    torch.testing.assert_close(rows[0], want_rows[0], atol=bound, rtol=0)


def test_fp8_checkpoint_refusals(float_checkpoint: Path, tmp_path: Path) -> None:
    folder = write(float_checkpoint, tmp_path, "blocks")
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    for change, says in [({"activation_scheme": "per-head"}, "dynamic or static"),
                         ({"fmt": "e5m2"}, "only e4m3"),
                         ({"weight_block_size": [64, 64]}, "weight_scale_inv of shape")]:
        (folder / "config.json").write_text(json.dumps(config | {"quantization_config":
                                                                  qc | change}))
        with pytest.raises(ValueError, match=says):
            load_model(folder, torch.float32, CPU)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with fp8 .* 'int8' was asked"):
        load_model(folder, torch.float32, CPU, quantization="int8")
