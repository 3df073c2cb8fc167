"""The one-call decoder stack over bf16 (`kp_decoder_stack_bf16`) against the per-layer modules.

Where the bf16 stack is built (the projections on the native bf16 GEMM: AVX512-BF16 without
AMX, `cpu_native.native_bf16_linear()`; a Llama-family layer with no window or q/k norm and a
head dim the bf16 prefill tiles take), it runs the per-layer bf16 path's kernels in the same
order, so hidden states and the KV it writes are equal bit for bit. Elsewhere the model runs
per-layer modules and says why: that is what holds on the other machine types.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_kernels import cpu_native
from tests.helpers.decoder_stack_runs import (
    Run,
    long_steps,
    mixed_steps,
    one_step_inputs,
    stack_and_modules,
)
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint

# Families the bf16 stack declines even where the bf16 GEMM runs, and why.
DECLINED_BF16 = {
    "mistral_window": "sliding windows in bf16",
    "phi3_window_mha": "sliding windows in bf16",
    "qwen3_qk_norm": "q/k norm in bf16",
    "llama_gqa_llama3": "head dim 16 in bf16",
    "gemma3_window_local_rope": "Gemma's layer in bf16",
}


def _run(model) -> Run:  # noqa: ANN001
    sim = PagedSim(model, seed=3)
    sim.kv = [kv.bfloat16() for kv in sim.kv]
    logits = [sim.step(batch) for batch in mixed_steps(11)]
    sim2 = PagedSim(model, seed=5)
    sim2.kv = [kv.bfloat16() for kv in sim2.kv]
    logits += [sim2.step(batch) for batch in long_steps(2)]
    return logits, sim.kv + sim2.kv


def test_bf16_stack_equals_per_layer_modules_bit_for_bit(tmp_path: Path) -> None:
    path, _ = save_checkpoint(CONFIGS["llama_hd64_inter100"], tmp_path)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    if not cpu_native.native_bf16_linear():
        assert model.native_stack is None
        assert model.native_stack_declined == "a projection is not on the native bf16 GEMM or quantized kernel"
        return
    assert model.native_stack is not None, model.native_stack_declined
    assert model.native_stack.dtype == torch.bfloat16
    stacked, layered = stack_and_modules(model, _run)
    for a, b in zip(stacked[0] + stacked[1], layered[0] + layered[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(DECLINED_BF16))
def test_bf16_stack_declines_what_it_cannot_compute_and_says_why(name: str,
                                                                 tmp_path: Path) -> None:
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert model.native_stack is None
    want = (DECLINED_BF16[name] if cpu_native.native_bf16_linear()
            else "a projection is not on the native bf16 GEMM or quantized kernel")
    assert model.native_stack_declined == want or want in model.native_stack_declined


def test_bf16_stack_rejects_a_position_past_the_table_and_a_slot_past_the_cache(
        tmp_path: Path) -> None:
    """The bf16 stack checks positions and slots before its one parallel region and leaves the
    cache untouched when one is out of range (the per-layer loop raises as the modules do)."""
    path, _ = save_checkpoint(CONFIGS["llama_hd64_inter100"], tmp_path)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    if model.native_stack is None:
        assert not cpu_native.native_bf16_linear()
        return
    ids, _, kv, meta = one_step_inputs(model, [0, 1], [0, 1])
    kv = [c.bfloat16() for c in kv]
    pos = torch.tensor([0, model.max_position_embeddings])
    with torch.inference_mode(), pytest.raises(IndexError, match="rotary table"):
        model(ids, pos, kv, meta)
    assert all(not c.any() for c in kv)
    ids, pos, kv, meta = one_step_inputs(model, [0, 1], [0, 8 * 4])
    kv = [c.bfloat16() for c in kv]
    with torch.inference_mode(), pytest.raises(IndexError, match="KV slot"):
        model(ids, pos, kv, meta)
    assert all(not c.any() for c in kv)
    ids, pos, kv, meta = one_step_inputs(model, [0, 1], [0, 1])
    kv = [c.bfloat16() for c in kv]
    with torch.inference_mode():
        model(ids, pos, kv, meta)
    assert all(c.any() for c in kv)  # in range: the step writes every layer's cache
