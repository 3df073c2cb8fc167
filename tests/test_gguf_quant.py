"""`--quantization gguf`: a GGUF's 4-bit and Q8_0 tensors served as they are stored (groups of
32; Q8_0 re-quantized per channel where PyTorch's int8 kernel runs), the rest float; checked
against the same file dequantized to float32 (what serving without `--quantization` runs), on
tiny GGUFs written here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.model_executor.layers import Linear  # noqa: E402
from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.quantization import gguf_blocks  # noqa: E402
from kserve_paged_engine.model_executor.quantization.layouts import Int8Embedding, projections  # noqa: E402
from kserve_paged_kernels import quant_linear  # noqa: E402
from tests.helpers import tiny_gguf  # noqa: E402
from tests.helpers.tiny_models import greedy  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23, 70, 11, 54, 36]
ALL_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.mark.parametrize("qtype", [*gguf_blocks.INT4_TYPES, *gguf_blocks.INT8_TYPES])
def test_blocks_read_as_groups_match_the_gguf_dequantizer(qtype: QT) -> None:
    rows, cols = 6, 512
    raw = tiny_gguf.random_blocks(qtype, rows, cols, np.random.default_rng(0))
    if qtype in gguf_blocks.INT8_TYPES:
        codes, scale = gguf_blocks.int8_groups(raw, rows, cols, qtype)
        group = 16 if qtype == QT.Q6_K else 32
        assert codes.dtype == np.int8 and scale.shape == (rows, cols // group)
        ours = (torch.from_numpy(codes).float()
                * torch.from_numpy(scale).repeat_interleave(group, 1))
    else:
        codes, scale, minimum = gguf_blocks.int4_groups(raw, qtype, rows, cols)
        assert codes.max() <= 15 and scale.shape == minimum.shape == (rows, cols // 32)
        ours = quant_linear.dequant_int4_reference(
            torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum), 32)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))
    torch.testing.assert_close(ours, expected, atol=1e-7, rtol=0)


def _load_pair(path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    dequantized, _ = load_model(path, torch.float32, CPU)
    kept, _ = load_model(path, torch.float32, CPU, quantization="gguf")
    return dequantized, kept


MIXED = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
         "ffn_gate": QT.Q4_1, "ffn_up": QT.Q8_0}  # ffn_down: F32; gate/up mixed: float
# name -> (projection types, vocabulary type, expected layout per projection).
CASES = {
    "q4_0": (dict.fromkeys(ALL_PROJECTIONS, QT.Q4_0), QT.F32, quant_linear.Int4Weight),
    "q4_1-q8_0-vocab": (dict.fromkeys(ALL_PROJECTIONS, QT.Q4_1), QT.Q8_0, quant_linear.Int4Weight),
    "q4_k": (dict.fromkeys(ALL_PROJECTIONS, QT.Q4_K), QT.F32, quant_linear.Int4Weight),
    "mixed-q8_0-vocab": (MIXED, QT.Q8_0, {"qkv_proj": quant_linear.Int8Weight,
                                           "o_proj": quant_linear.Int4Weight,
                                           "gate_up_proj": type(None),
                                           "down_proj": type(None)}),
}


def _layouts(model: torch.nn.Module, expected: type | dict[str, type]) -> None:
    for name, linear in projections(model):
        want = expected if isinstance(expected, type) else expected[name.rsplit(".", 1)[1]]
        assert isinstance(linear.quant, want), name
        if linear.quant is not None:
            assert linear.weight.numel() == 0  # the float copy is gone


def _vocab(kept: torch.nn.Module, dequantized: torch.nn.Module, quantized: bool
           ) -> list[tuple[quant_linear.QuantWeight, torch.Tensor]]:
    """(our int8 weight, transformers' float one) of the embedding and the head, or none."""
    embedding = kept.model.embed_tokens
    assert isinstance(embedding, Int8Embedding) == quantized
    if not quantized:
        return []
    assert isinstance(kept.lm_head.quant, quant_linear.Int8Weight)
    ids = torch.tensor(PROMPT)
    torch.testing.assert_close(embedding(ids), quant_linear.dequant(embedding.weight_q)[ids])
    return [(embedding.weight_q, dequantized.model.embed_tokens.weight),
            (kept.lm_head.quant, dequantized.lm_head.weight)]


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_served_exactly_on_the_float32_kernel(tmp_path: Path, case: str) -> None:
    """With float32 activations every 4-bit and Q8_0 tensor (projections, embedding, head) is
    kept with its own groups (the native kernel): each packed weight stands for transformers'
    dequantized one, greedy tokens are equal and the logits within 1e-3. The one-call native
    decoder stack runs the quantized projections, equal bit for bit to the per-layer modules."""
    types, vocab, expected = CASES[case]
    dequantized, kept = _load_pair(tiny_gguf.write(tmp_path / "m.gguf", types, vocab=vocab))
    _layouts(kept, expected)
    float_weights = dict(projections(dequantized))
    pairs = [(m.quant, float_weights[n].weight) for n, m in projections(kept) if m.quant]
    for ours, ref in pairs + _vocab(kept, dequantized, vocab != QT.F32):
        assert ours.kernel == "native"
        torch.testing.assert_close(quant_linear.dequant(ours), ref.detach(), atol=1e-6, rtol=0)
    assert kept.native_stack is not None, kept.native_stack_declined
    tokens, logits = greedy(kept, PROMPT, 6)
    ref_tokens, ref_logits = greedy(dequantized, PROMPT, 6)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert float((ours - ref).abs().max()) < 1e-3
    kept.use_native_stack = False
    layer_tokens, layer_logits = greedy(kept, PROMPT, 6)
    assert layer_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(layer_logits, logits, strict=True))


def test_q6_k_kept_exactly_and_q5_k_requantized_within_half_a_step(tmp_path: Path) -> None:
    """Q6_K is int8 in groups of 16 (exact), fused with Q8_0's groups of 32 by repeating their
    scales; Q5_K has no exact layout here: its rows become int8 in groups of 32, each weight
    within half its group's step, fused with a Q8_0 part kept exact. What Gemma-3's Q4_K_M
    file mixes (Q4_K, Q5_0, Q6_K, Q8_0)."""
    types = {"attn_q": QT.Q6_K, "attn_k": QT.Q8_0, "attn_v": QT.Q6_K, "attn_output": QT.Q6_K,
             "ffn_gate": QT.Q5_K, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_K}
    path = tiny_gguf.write(tmp_path / "k.gguf", types, vocab=QT.Q6_K)
    dequantized, kept = _load_pair(path)
    _layouts(kept, {"qkv_proj": quant_linear.Int8Weight, "o_proj": quant_linear.Int8Weight,
                    "gate_up_proj": quant_linear.Int8Weight,
                    "down_proj": quant_linear.Int4Weight})
    float_weights = dict(projections(dequantized))
    for name, linear in projections(kept):
        ref = float_weights[name].weight.detach()
        err = (quant_linear.dequant(linear.quant) - ref).abs()
        if name.endswith("gate_up_proj"):  # gate rows (Q5_K) re-quantized, up rows exact
            gate = tiny_gguf.INTER
            step = ref[:gate].reshape(gate, -1, 32).abs().amax(-1) / 127
            assert bool((err[:gate] <= step.repeat_interleave(32, 1) / 2 + 1e-7).all())
            assert float(err[:gate].max()) > 0 and float(err[gate:].max()) <= 1e-6
        else:
            assert float(err.max()) <= 1e-6, name
    for ours, ref in _vocab(kept, dequantized, True):
        torch.testing.assert_close(quant_linear.dequant(ours), ref.detach(), atol=1e-6, rtol=0)
    tokens, logits = greedy(kept, PROMPT, 4)
    ref_tokens, ref_logits = greedy(dequantized, PROMPT, 4)
    assert tokens == ref_tokens
    scale = max(float(r.abs().max()) for r in ref_logits)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)
               ) < 0.02 * scale


def test_without_the_native_kernel_q8_0_is_requantized_per_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's int8 kernel takes one scale per output channel (or row): Q8_0 projections,
    embedding and head are re-quantized, each weight within half its channel's step of the
    Q8_0 value; 4-bit ones stay exact on PyTorch's int4 kernel."""
    monkeypatch.setattr(quant_linear, "native_for", lambda dtype: False)
    types, vocab, expected = CASES["mixed-q8_0-vocab"]
    dequantized, kept = _load_pair(tiny_gguf.write(tmp_path / "m.gguf", types, vocab=vocab))
    _layouts(kept, expected)
    float_weights = dict(projections(dequantized))
    pairs = [(m.quant, float_weights[n].weight) for n, m in projections(kept) if m.quant]
    for ours, ref in pairs + _vocab(kept, dequantized, True):
        assert ours.kernel == "aten"
        err = (quant_linear.dequant(ours) - ref).abs()
        if isinstance(ours, quant_linear.Int8Weight):
            assert bool((err <= ours.scales[:, None] / 2 + 1e-7).all())
        else:
            assert float(err.max()) <= 1e-6
    tokens, logits = greedy(kept, PROMPT, 4)
    ref_tokens, ref_logits = greedy(dequantized, PROMPT, 4)
    assert tokens == ref_tokens
    scale = max(float(r.abs().max()) for r in ref_logits)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)
               ) < 0.02 * scale


def test_plain_gguf_load_stays_float(tmp_path: Path) -> None:
    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(ALL_PROJECTIONS, QT.Q4_1))
    model, _ = load_model(path, torch.float32, CPU)
    assert all(m.quant is None for m in model.modules() if isinstance(m, Linear))


def test_gguf_in_bf16_close_to_the_dequantized_bf16_model(tmp_path: Path) -> None:
    """With bf16 activations the 4-bit projections and the Q8_0 vocabulary run on our kernel
    where `native_bf16_quant()` chose it (PyTorch's elsewhere), exact codes and fp32 scales;
    greedy tokens equal those of the same file dequantized into a bf16 model, logits within 2%
    of their range on ours (bf16 roundings differ in place, not in size), 5% on PyTorch's
    (its scales rounded to bf16, the Q8_0 vocabulary re-quantized per row). Where the bf16
    decoder stack is built it equals the per-layer modules bit for bit; elsewhere it says
    why."""
    from kserve_paged_kernels import cpu_native

    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(ALL_PROJECTIONS, QT.Q4_1),
                           vocab=QT.Q8_0)
    dense, _ = load_model(path, torch.bfloat16, CPU)
    kept, _ = load_model(path, torch.bfloat16, CPU, quantization="gguf")
    _layouts(kept, quant_linear.Int4Weight)
    want = "native" if cpu_native.native_bf16_quant() else "aten"
    assert {m.quant.kernel for _, m in projections(kept)} == {want}
    assert kept.lm_head.quant.kernel == want
    tokens, logits = greedy(kept, PROMPT, 6, torch.bfloat16)
    ref_tokens, ref_logits = greedy(dense, PROMPT, 6, torch.bfloat16)
    assert tokens == ref_tokens
    scale = max(float(r.float().abs().max()) for r in ref_logits)
    assert max(float((a.float() - b.float()).abs().max())
               for a, b in zip(logits, ref_logits, strict=True)
               ) < (0.02 if want == "native" else 0.05) * scale
    if kept.native_stack is None:
        assert want == "aten" and "quantized kernel" in kept.native_stack_declined
        return
    kept.use_native_stack = False
    layer_tokens, layer_logits = greedy(kept, PROMPT, 6, torch.bfloat16)
    assert layer_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(layer_logits, logits, strict=True))


def _old_two_read_groups(path: Path, config: object) -> dict[str, tuple[torch.Tensor, ...]]:
    """What the loader did before reading the file once: transformers dequantizes every tensor,
    the raw blocks are read again and put in the row order (as stored, or undoing llama.cpp's
    q/k permutation) whose values equal transformers' tensor."""
    import gguf
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).state_dict()
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, tiny_gguf.LAYERS)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    out = {}
    for hf_name, ref in state.items():
        key = hf_name.removesuffix(".weight")
        raw = tensors.get(f"{table.get_name(key)}.weight")
        if raw is None or QT(raw.tensor_type) not in gguf_blocks.INT4_TYPES:
            continue
        groups = gguf_blocks.int4_groups(np.asarray(raw.data), QT(raw.tensor_type), *ref.shape)
        for heads in (1, tiny_gguf.HEADS, tiny_gguf.KV_HEADS):
            rows = ref.shape[0]
            order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(
                rows) if heads > 1 else np.arange(rows)
            codes, scale, minimum = (a[order] for a in groups)
            deq = (codes.astype(np.float32).reshape(*scale.shape, -1) * scale[..., None]
                   + minimum[..., None]).reshape(ref.shape)
            if np.array_equal(deq, ref.numpy()):
                out[key] = tuple(torch.from_numpy(np.ascontiguousarray(a))
                                 for a in (codes, scale, minimum))
                break
    return out


def test_one_read_gives_the_two_read_paths_groups_and_floats(tmp_path: Path) -> None:
    """The file read once (engine/kserve_paged_engine/model_executor/quantization/gguf_read.py) gives each 4-bit projection the
    very codes, scales and minimums (so the very packed weight) the old two-read path found, in
    the same row order (q and k permuted back), and the float tensors transformers gives."""
    from transformers import AutoConfig

    from kserve_paged_engine.model_executor.model_loader import _expected_weights
    from kserve_paged_engine.model_executor.quantization import gguf_read

    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(ALL_PROJECTIONS, QT.Q4_K))
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    read = gguf_read.read(path, config, _expected_weights(config))
    state = dict(read.weights)  # fills read.groups
    old = _old_two_read_groups(path, config)
    assert len(old) == tiny_gguf.LAYERS * len(ALL_PROJECTIONS)
    for key, groups in old.items():
        ours = read.groups[key].int4
        assert ours is not None and all(torch.equal(a, b) for a, b in zip(ours, groups)), key
        packed = [quant_linear.pack_int4(*g, 32, torch.float32).packed for g in (ours, groups)]
        assert torch.equal(*packed)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                     dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        if name.removesuffix(".weight") in old:  # packed whatever the dtype: a zero stand-in
            assert tensor.stride() == (0, 0) and tensor.shape == reference[name].shape
        else:
            torch.testing.assert_close(tensor, reference[name], atol=1e-7, rtol=0)


def test_start_up_log_names_each_kind_of_projection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    types, vocab, _ = CASES["mixed-q8_0-vocab"]
    caplog.set_level("INFO", logger="kserve_paged_engine")
    load_model(tiny_gguf.write(tmp_path / "m.gguf", types, vocab=vocab), torch.float32, CPU,
               quantization="gguf")
    line = next(r.getMessage() for r in caplog.records if "decoder projections" in
                r.getMessage())
    assert "q/k/v: int8 g32 (Q8_0, exact) [native kernel]" in line
    assert "o: int4 g32 (Q4_0, exact) [native kernel]" in line
    assert "gate/up: float32 (from Q4_1+Q8_0)" in line and "down: float32" in line
    assert "embedding and LM head: int8 g32 (Q8_0, exact)" in line
    assert line.endswith("float32 activations")
