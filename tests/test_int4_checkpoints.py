"""AWQ and GPTQ checkpoints: their 4-bit projections served as the checkpoint stores them, checked
against the same checkpoint dequantized into a float folder, on tiny random Llamas whose
projections are quantized and packed here from the formats' definitions (AWQ's interleaved
output columns, GPTQ's words along the input dimension and its zeros stored minus one)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.quantization import int4_checkpoints  # noqa: E402
from kserve_paged_engine.model_executor.quantization.layouts import projections  # noqa: E402
from kserve_paged_kernels import int4_layouts, quant_linear  # noqa: E402
from tests.helpers.int4_packing import int32_words, read_checkpoint  # noqa: E402
from tests.helpers.quantized_checkpoints import write_int4 as _write  # noqa: E402
from tests.helpers.tiny_models import CONFIGS, greedy, save_checkpoint  # noqa: E402
from tests.kernels.interpreted import run_calls  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23]


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path_factory.mktemp("float"))
    return folder


def test_words_unpack_as_each_format_packs_them() -> None:
    words = torch.tensor([[0x76543210, int32_words(torch.tensor(0xF0000000)).item()]],
                         dtype=torch.int32)
    assert int4_layouts.unpack(words, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7,
                                                          0, 0, 0, 0, 0, 0, 0, 15]]
    assert int4_layouts.unpack(words[:, :1], 0).flatten().tolist() == list(range(8))
    # AWQ: nibble i is output column AWQ_PACK_ORDER[i]; column j reads nibble order.index(j).
    assert int4_layouts.awq_columns(words[:, :1]).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_served_with_its_own_codes(float_checkpoint: Path, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture,
                                              method: str) -> None:
    folder = _write(float_checkpoint, tmp_path, method)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        kept, _ = load_model(folder, torch.float32, CPU)  # no flag: the checkpoint says
    assert f"quantization {method} (checkpoint): decoder projections" in caplog.text
    floats = dict(projections(reference))
    for name, linear in projections(kept):
        assert isinstance(linear.quant, quant_linear.Int4Weight), name
        assert linear.weight.numel() == 0
        torch.testing.assert_close(quant_linear.dequant(linear.quant), floats[name].weight,
                                   atol=1e-6, rtol=0)
    tokens, logits = greedy(kept, PROMPT, 5)
    ref_tokens, ref_logits = greedy(reference, PROMPT, 5)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)) < 1e-3


def test_activation_order_gptq_is_served_dequantized_and_said(
        float_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _write(float_checkpoint, tmp_path, "gptq", act_order=True)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        kept, _ = load_model(folder, torch.float32, CPU, quantization="gptq")
    assert "dequantized: groups the packed kernel cannot read" in caplog.text
    assert all(linear.quant is None for _, linear in projections(kept))
    floats = dict(projections(reference))
    for name, linear in projections(kept):
        torch.testing.assert_close(linear.weight, floats[name].weight, atol=1e-6, rtol=0)


def test_layouts_not_served_fail_before_loading(float_checkpoint: Path, tmp_path: Path) -> None:
    folder = _write(float_checkpoint, tmp_path, "awq")
    with pytest.raises(ValueError, match="quantized with awq .* 'gptq' was asked"):
        load_model(folder, torch.float32, CPU, quantization="gptq")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        load_model(float_checkpoint, torch.float32, CPU, quantization="gptq")
    with pytest.raises(ValueError, match="CPU only"):
        load_model(folder, torch.float32, torch.device("meta"))
    config = json.loads((folder / "config.json").read_text())
    for change, says in (({"bits": 8}, "8-bit weights"), ({"group_size": 100}, "group_size 100"),
                         ({"version": "gemv"}, "only the 'gemm' layout"),
                         ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'")):
        qc = config["quantization_config"] | change
        (folder / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(ValueError, match=says):
            load_model(folder, torch.float32, CPU)


@pytest.mark.parametrize(("method", "act_order"), [("awq", False), ("gptq", True)])
def test_words_kept_as_stored_for_the_triton_gemm(float_checkpoint: Path, tmp_path: Path,
                                                  method: str, act_order: bool) -> None:
    """What CUDA gets: each projection's words as stored, q/k/v and gate/up stacked along the
    output (activation order too: the GEMM reads g_idx per row), standing for the reference
    weight; one fused projection multiplied by the Triton GEMM (interpreted without CUDA)."""
    folder = _write(float_checkpoint, tmp_path, method, act_order=act_order)
    reference, _ = load_model(folder / "float", torch.float32, CPU)
    reader = read_checkpoint(int4_checkpoints.Int4Reader, int4_checkpoints.read_config, folder)
    pick = reader.picker(torch.float32, triton=True)
    kept = {}
    for name, linear in projections(reference):
        label, weight = pick(name, linear)
        parts = int4_checkpoints.hf_parts(name)
        if act_order and len(parts) > 1:  # each part has its own input order: not stacked
            assert weight is None and "dequantized" in label
            continue
        assert isinstance(weight, int4_layouts.CheckpointInt4Weight) and "Triton" in label
        torch.testing.assert_close(quant_linear.dequant(weight), linear.weight, atol=1e-6,
                                   rtol=0)
        kept[name] = weight
    name = "model.layers.0.mlp.gate_up_proj" if not act_order else "model.layers.0.mlp.down_proj"
    x = torch.randn(3, kept[name].in_features)
    ((got, _),) = run_calls([("kserve_paged_kernels.quant_linear", "matmul", (x, kept[name]), {})], tmp_path)
    torch.testing.assert_close(got, x @ dict(projections(reference))[name].weight.t(),
                               atol=1e-4, rtol=1e-5)
