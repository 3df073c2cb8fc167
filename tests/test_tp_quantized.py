"""Tensor parallelism with quantized weights: each format cut per rank in its packed form
(engine/kserve_paged_engine/model_executor/quantization/tp_cuts.py), TP = 2 giving TP = 1's
greedy tokens with logits close, through the engine, on tiny random checkpoints; and a shape
that cannot be cut refused at load, naming the projection and the shape.

One kept pair of processes (this one and one spawned worker) serves every engine of the module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import LlamaConfig

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.quantization.int4_checkpoints import (
    Int4Checkpoint,
    checkpoint_weight,
)
from kserve_paged_engine.model_executor.quantization.tp_cuts import cut_int4
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.tp_executor import TPExecutor
from kserve_paged_kernels import quant_linear
from kserve_paged_kernels.int4_layouts import dequant_checkpoint
from tests.helpers import tiny_gguf
from tests.helpers import tp_quant_checkpoints as ckpts
from tests.helpers.int4_packing import checkpoint_parts
from tests.helpers.step_logits import record_step_logits
from tests.helpers.tiny_models import copy_default_tokenizer

PROMPTS = [[5, 17, 40, 9, 88, 61, 23], [71, 3, 90, 14]]  # ids < the GGUF's 96
# Logits within this fraction of the step's largest: the all-reduce sums the row-parallel
# partial products in another order than one GEMM over the whole row.
RELATIVE = 1e-4
GGUF_TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_0, "attn_v": QT.Q4_1, "attn_output": QT.Q6_K,
              "ffn_gate": QT.Q8_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_K}


def _gguf(tmp: Path, types: dict[str, QT] = GGUF_TYPES) -> tuple[Path, str | None]:
    """A GGUF folder: the tiny GGUF, its config.json and the default model's tokenizer."""
    tiny_gguf.write(tmp / "m.gguf", types, vocab=QT.Q8_0)
    LlamaConfig(vocab_size=tiny_gguf.VOCAB, hidden_size=tiny_gguf.HIDDEN,
                intermediate_size=tiny_gguf.INTER, num_hidden_layers=tiny_gguf.LAYERS,
                num_attention_heads=tiny_gguf.HEADS, num_key_value_heads=tiny_gguf.KV_HEADS,
                max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp)
    copy_default_tokenizer(tmp)
    return tmp, "gguf"


def _float(tmp: Path) -> Path:
    return ckpts.float_llama(tmp / "float")


# format -> (tmp folder -> (model path, --quantization)); the checkpoint formats need no flag.
CASES: dict[str, Callable[[Path], tuple[Path, str | None]]] = {
    "gguf": _gguf,
    # Q5_K: read dequantized, re-quantized to int8 g32 per rank from its cut rows and columns.
    "gguf_q5_k": lambda t: _gguf(t, dict.fromkeys(GGUF_TYPES, QT.Q5_K)),
    "awq": lambda t: (ckpts.int4(_float(t), t / "q", "awq"), None),
    "gptq": lambda t: (ckpts.int4(_float(t), t / "q", "gptq"), None),
    "gptq_act_order": lambda t: (ckpts.int4(_float(t), t / "q", "gptq", act_order=True), None),
    "ct_w4a16_asym": lambda t: (ckpts.compressed(_float(t), t / "q", "w4a16_asym"), None),
    "ct_w8a8": lambda t: (ckpts.compressed(_float(t), t / "q", "w8a8"), None),
    "ct_fp8": lambda t: (ckpts.compressed(_float(t), t / "q", "fp8"), None),
    "fp8": lambda t: (ckpts.fp8(_float(t), t / "q"), None),
    "fp8_blocks": lambda t: (ckpts.fp8(_float(t), t / "q", (16, 32)), None),
    "int4": lambda t: (_float(t), "int4"),
    "int8": lambda t: (_float(t), "int8"),
    "online_fp8": lambda t: (_float(t), "fp8"),
}
FAST = ("gguf", "awq", "ct_w8a8")
# Served dequantized on CPU at any TP (activation order: the packed kernel needs runs of inputs).
DEQUANTIZED = ("gptq_act_order",)


@pytest.fixture(scope="module")
def workers():
    pool = TPExecutor(2, torch.device("cpu")).keep()
    yield pool
    pool.stop()


def _run(model: Path, quantization: str | None, tp: int
         ) -> tuple[list[list[int]], list[torch.Tensor], list[str]]:
    """Greedy tokens per prompt, every step's sampling logits, and the quantized layouts of
    rank 0's projections."""
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=tp,
                                    quantization=quantization, num_kv_blocks=32, block_size=4,
                                    max_model_len=64))
    steps = record_step_logits(engine)
    try:
        layouts = sorted({type(m.quant).__name__ for m in engine.model.modules()
                          if getattr(m, "quant", None) is not None})
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))], steps, layouts
    finally:
        engine.close()


def _assert_same(one, two, quantized: bool = True) -> None:
    tokens1, steps1, layouts1 = one
    tokens2, steps2, layouts2 = two
    assert layouts2 == layouts1 and bool(layouts1) == quantized  # the same layouts
    assert tokens2 == tokens1
    assert len(steps2) == len(steps1)
    for a, b in zip(steps1, steps2, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= RELATIVE * a.abs().max().item()


def _case(name: str, workers: TPExecutor, tmp_path: Path) -> None:
    model, quantization = CASES[name](tmp_path)
    _assert_same(_run(model, quantization, 1), _run(model, quantization, 2),
                 name not in DEQUANTIZED)


@pytest.mark.parametrize("name", FAST)
def test_tp2_matches_tp1(name: str, workers: TPExecutor, tmp_path: Path) -> None:
    _case(name, workers, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - set(FAST)))
def test_tp2_matches_tp1_more_formats(name: str, workers: TPExecutor, tmp_path: Path) -> None:
    _case(name, workers, tmp_path)


def test_uncuttable_groups_are_refused_naming_the_projection(workers: TPExecutor,
                                                             tmp_path: Path) -> None:
    """MLP 96 over 2 ranks is 48 + 48: down_proj's input columns 0:48 split a group of 32."""
    folder = ckpts.int4(ckpts.float_llama(tmp_path / "float", intermediate_size=96),
                        tmp_path / "q", "gptq")
    with pytest.raises(ValueError, match=r"down_proj \[64, 96\].* 0:48 .*32-wide"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", tensor_parallel_size=2,
                               num_kv_blocks=8, block_size=4, max_model_len=32))
    # Every rank answered: the workers are still there for the next engine.
    assert TPExecutor._kept is workers and not workers.in_use and workers.failure is None


def test_int4_words_cut_in_packed_form_stand_for_the_cut_weight() -> None:
    """AWQ's and GPTQ's words cut on either side (no engine) dequantize to that cut of the
    whole weight, and a cut off the group boundary is refused, naming shape and range."""
    w = torch.randn(48, 128)
    for method in ("gptq", "awq"):
        parts, deq = checkpoint_parts(w, torch.arange(128) // 32, method)
        whole = checkpoint_weight(parts, Int4Checkpoint(method, 32, int(method == "gptq")))
        assert torch.equal(dequant_checkpoint(cut_int4("p", whole, (0, 16, 24))), deq[16:40])
        assert torch.equal(dequant_checkpoint(cut_int4("p", whole, (1, 64, 64))), deq[:, 64:])
        with pytest.raises(ValueError, match=r"p \[48, 128\].*input columns 16:80"):
            cut_int4("p", whole, (1, 16, 64))


def test_gguf_4bit_embedding_and_head_are_read_not_stand_ins(tmp_path: Path) -> None:
    """A Q4_K embedding and LM head (TP = 1 re-quantizes them per row, TP > 1 keeps them float)
    come from their blocks, not from the zero stand-in a 4-bit projection streams."""
    path = tiny_gguf.write(tmp_path / "m.gguf", {"attn_q": QT.Q4_K}, vocab=QT.Q4_K)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), quantization="gguf")
    dense, _ = load_model(path, torch.float32, torch.device("cpu"))  # transformers' dequantizer
    ids = torch.arange(tiny_gguf.VOCAB)
    rows, expected = model.model.embed_tokens(ids), dense.model.embed_tokens(ids)
    step = expected.abs().amax(1, keepdim=True) / 254  # half an int8 step per row
    assert expected.abs().max() > 0 and ((rows - expected).abs() <= step * 1.01).all()
    head = quant_linear.dequant(model.lm_head.quant)
    assert ((head - dense.lm_head.weight).abs()
            <= dense.lm_head.weight.abs().amax(1, keepdim=True) / 254 * 1.01).all()


@pytest.mark.slow
def test_tp4_gguf_matches_tp1(workers: TPExecutor, tmp_path: Path) -> None:
    """4 ranks: one query head each, the 2 KV heads replicated on 2 ranks each; o_proj's 64
    input columns and down_proj's 128 cut on whole groups of 32 (Q6_K's of 16). Runs last:
    the module's TP = 2 pool gives way to a TP = 4 one."""
    model, quantization = _gguf(tmp_path)
    one = _run(model, quantization, 1)
    workers.stop()
    four = TPExecutor(4, torch.device("cpu")).keep()
    try:
        _assert_same(one, _run(model, quantization, 4))
    finally:
        four.stop()
