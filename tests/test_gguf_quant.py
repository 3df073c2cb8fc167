"""`--quantization gguf`: a GGUF's 4-bit projections served as they are stored (int4 groups of
32), Q8_0 re-quantized per channel, the rest float; checked against the same file dequantized
to float32 (what serving without `--quantization` runs), on tiny GGUFs written here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.model_executor import gguf_blocks  # noqa: E402
from engine.model_executor.layers import Linear  # noqa: E402
from engine.model_executor.model_loader import load_model  # noqa: E402
from engine.model_executor.quantization import Int8Embedding, projections  # noqa: E402
from kernels import quant_linear  # noqa: E402
from tests.helpers import tiny_gguf  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23, 70, 11, 54, 36]
ALL_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.mark.parametrize("qtype", gguf_blocks.INT4_TYPES)
def test_blocks_read_as_groups_match_the_gguf_dequantizer(qtype: QT) -> None:
    rows, cols = 6, 512
    raw = tiny_gguf.random_blocks(qtype, rows, cols, np.random.default_rng(0))
    codes, scale, minimum = gguf_blocks.int4_groups(raw, qtype, rows, cols)
    assert codes.max() <= 15 and scale.shape == minimum.shape == (rows, cols // 32)
    ours = quant_linear.dequant_int4_reference(torch.from_numpy(codes), torch.from_numpy(scale),
                                               torch.from_numpy(minimum), 32)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))
    torch.testing.assert_close(ours, expected, atol=1e-7, rtol=0)


def _greedy(model: torch.nn.Module, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    sim = PagedSim(model, seed=0)
    logits = sim.step([(0, PROMPT)])
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = sim.step([(0, [tokens[-1]])])
        rows.append(logits)
    return tokens, rows


def _load_pair(path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    dequantized, _ = load_model(path, torch.float32, CPU)
    kept, _ = load_model(path, torch.float32, CPU, quantization="gguf")
    return dequantized, kept


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
def test_4bit_gguf_served_exactly(tmp_path: Path, qtype: QT) -> None:
    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(ALL_PROJECTIONS, qtype))
    dequantized, kept = _load_pair(path)
    for name, linear in projections(kept):
        assert isinstance(linear.quant, quant_linear.Int4Weight), name
        assert linear.weight.numel() == 0  # the float copy is gone
    # Every projection's packed weight stands for transformers' dequantized one.
    float_weights = dict(projections(dequantized))
    for name, linear in projections(kept):
        assert linear.quant is not None
        torch.testing.assert_close(quant_linear.dequant(linear.quant),
                                   float_weights[name].weight, atol=1e-6, rtol=0)
    tokens, logits = _greedy(kept, 6)
    ref_tokens, ref_logits = _greedy(dequantized, 6)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert float((ours - ref).abs().max()) < 1e-3


def test_q8_0_requantized_per_channel_and_other_types_kept(tmp_path: Path) -> None:
    """Q8_0 becomes int8 with one scale per channel (each weight within half a step of the
    Q8_0 value); a fused projection mixing types, and F32 ones, stay float."""
    types = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
             "ffn_gate": QT.Q4_1, "ffn_up": QT.Q8_0}  # ffn_down: F32
    path = tiny_gguf.write(tmp_path / "mixed.gguf", types)
    dequantized, kept = _load_pair(path)
    float_weights = dict(projections(dequantized))
    formats = {name.rsplit(".", 1)[1]: type(m.quant) for name, m in projections(kept)}
    assert formats == {"qkv_proj": quant_linear.Int8Weight, "o_proj": quant_linear.Int4Weight,
                       "gate_up_proj": type(None), "down_proj": type(None)}
    for name, linear in projections(kept):
        if isinstance(linear.quant, quant_linear.Int8Weight):
            err = (quant_linear.dequant(linear.quant) - float_weights[name].weight).abs()
            assert bool((err <= linear.quant.scales[:, None] / 2 + 1e-7).all())
    tokens, logits = _greedy(kept, 4)
    ref_tokens, ref_logits = _greedy(dequantized, 4)
    assert tokens == ref_tokens
    scale = max(float(r.abs().max()) for r in ref_logits)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)
               ) < 0.02 * scale


def test_plain_gguf_load_stays_float(tmp_path: Path) -> None:
    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(ALL_PROJECTIONS, QT.Q4_1))
    model, _ = load_model(path, torch.float32, CPU)
    assert all(m.quant is None for m in model.modules() if isinstance(m, Linear))


def test_quantized_embedding_and_head_become_int8_rows(tmp_path: Path) -> None:
    """A Q8_0 embedding and output: int8 with one scale per row (each weight within half its
    row's step of the Q8_0 value), shared by lookup and head when tied."""
    path = tiny_gguf.write(tmp_path / "v.gguf", dict.fromkeys(ALL_PROJECTIONS, QT.Q4_1),
                           vocab=QT.Q8_0)
    dequantized, kept = _load_pair(path)
    embedding = kept.model.embed_tokens
    assert isinstance(embedding, Int8Embedding)
    assert isinstance(kept.lm_head.quant, quant_linear.Int8Weight)
    for ours, ref in ((embedding.weight_q, dequantized.model.embed_tokens.weight),
                      (kept.lm_head.quant, dequantized.lm_head.weight)):
        err = (quant_linear.dequant(ours) - ref).abs()
        assert bool((err <= ours.scales[:, None] / 2 + 1e-7).all())
    ids = torch.tensor(PROMPT)
    torch.testing.assert_close(embedding(ids), quant_linear.dequant(embedding.weight_q)[ids])
    tokens, logits = _greedy(kept, 4)
    ref_tokens, ref_logits = _greedy(dequantized, 4)
    assert tokens == ref_tokens
    scale = max(float(r.abs().max()) for r in ref_logits)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)
               ) < 0.02 * scale
