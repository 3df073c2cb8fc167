"""`--quantization`: vLLM's values recognised (the ones not built are a clear error naming those
that are), and our int4/int8 for a float checkpoint quantized at load, checked against the
float model on tiny random Llamas."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged.args import parse_args  # noqa: E402
from kserve_paged_engine.config.engine import EngineConfig  # noqa: E402
from kserve_paged_engine.config.quantization import BUILT_METHODS  # noqa: E402
from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.quantization.layouts import projections  # noqa: E402
from kserve_paged_kernels import quant_linear  # noqa: E402
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23]


@pytest.mark.parametrize(("method", "says"), [("int3", "unknown")])
def test_methods_not_built_fail_at_config_naming_the_built_ones(method: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as exc:
        EngineConfig(quantization=method)
    assert all(m in str(exc.value) for m in BUILT_METHODS)


def test_quantization_composes_with_tensor_parallelism() -> None:
    # Cut per rank in packed form (tests/test_tp_quantized.py runs it).
    assert EngineConfig(quantization="int4", tensor_parallel_size=2).quantization == "int4"


def test_server_flag(capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["--quantization", "int4"]).quantization == "int4"
    assert parse_args([]).quantization is None
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int3"])
    assert "invalid choice" in capsys.readouterr().err


def test_loader_refuses_mismatched_methods(tmp_path: Path) -> None:
    folder, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    with pytest.raises(ValueError, match=r"needs a \.gguf"):
        load_model(folder, torch.float32, CPU, quantization="gguf")
    with pytest.raises(ValueError, match="CPU only"):
        load_model(folder, torch.float32, torch.device("meta"), quantization="int8")


@pytest.mark.parametrize(("method", "layout"), [("int4", quant_linear.Int4Weight),
                                                ("int8", quant_linear.Int8Weight)])
def test_on_the_fly_quantization_of_a_float_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, method: str, layout: type) -> None:
    """Each weight within half a quantization step of the float one, and the model computes
    what the float model does with those dequantized weights put in its place."""
    folder, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    dense, _ = load_model(folder, torch.float32, CPU)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        quantized, _ = load_model(folder, torch.float32, CPU, quantization=method)
    assert f"quantization {method}: decoder projections" in caplog.text
    floats = dict(projections(dense))
    assert floats and set(floats) == {name for name, _ in projections(quantized)}
    for name, linear in projections(quantized):
        assert isinstance(linear.quant, layout), name
        assert linear.weight.numel() == 0
        deq = quant_linear.dequant(linear.quant)
        err = (deq - floats[name].weight).abs()
        step = float(floats[name].weight.abs().max()) / (127 if method == "int8" else 7.5)
        assert 0 < float(err.max()) <= step / 2 + 1e-6
        floats[name].weight.copy_(deq)  # the reference: float model, dequantized weights
    assert quantized.lm_head.quant is None  # the embedding and LM head stay float
    dense.pack_weights()  # re-pack the float projections after the copy
    ours = PagedSim(quantized).step([(0, PROMPT)])
    ref = PagedSim(dense).step([(0, PROMPT)])
    assert float((ours - ref).abs().max()) < 1e-3


def test_engine_serves_with_quantization(tmp_path: Path) -> None:
    """EngineConfig's quantization reaches the loader: the engine's model runs on int4
    projections and generates, the same tokens twice."""
    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import tiny_default_folder

    tiny_default_folder(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tmp_path), load_format="dummy", seed=1, dtype="float32",
                  max_model_len=256, kv_cache_memory=8 << 20, quantization="int4")
        assert all(isinstance(m.quant, quant_linear.Int4Weight)
                   for _, m in projections(llm.engine.model))
        runs.append(llm.generate(["Hello there"], params)[0].outputs[0].token_ids)
    assert len(runs[0]) == 6 and runs[0] == runs[1]
