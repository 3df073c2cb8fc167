"""A mixture-of-experts layer's experts on the native packed fp32 GEMM (`SparseMoE.pack`).

The native library builds at every instruction-set level (AVX2 included), so what follows
holds on every supported machine: once loaded in float32 on CPU, each expert with tokens is one
`gemm_silu` and one `gemm`, with the routing and the grouping by expert of the torch path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.models import moe
from kserve_paged_kernels import cpu_native
from tests.helpers.tiny_models import CONFIGS, greedy, save_checkpoint


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # gcc is part of the supported machine (README): a missing build must fail, not skip.
    assert cpu_native.gemm_available(), "the native CPU kernels did not build"


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count `cpu_native.<name>` calls (rows of each) as the MoE layer makes them."""
    calls: list[int] = []
    real = getattr(cpu_native, name)

    def counted(x, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe.cpu_native, name, counted)
    return calls


def _layer(hidden: int, inter: int, experts: int, seed: int) -> moe.SparseMoE:
    """A random layer whose router never picks the last two experts: every row's feature 0
    is 3, and their router rows weigh it -100."""
    g = torch.Generator().manual_seed(seed)
    layer = moe.SparseMoE(hidden, inter, experts, top_k=2, renormalize=True).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.gate.weight[:, 0] = 0.0
        layer.gate.weight[-2:, 0] = -100.0
    return layer


def test_packed_experts_equal_the_torch_grouped_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden and intermediate sizes off the panel width (tail panels at 16 and 48 columns),
    tokens spread over several experts and two experts with none: one `gemm_silu` and one
    `gemm` per expert with tokens, over exactly its rows; the output is the torch path's."""
    torch.manual_seed(1)
    torch_layer = _layer(hidden=100, inter=40, experts=6, seed=1)
    x = torch.randn(37, 100)
    x[:, 0] = 3.0
    with torch.inference_mode():
        expected = torch_layer(x)
        _, picked = torch.topk(torch_layer.gate(x), 2, dim=-1)
    counts = torch.bincount(picked.flatten(), minlength=6)
    assert counts[-2:].tolist() == [0, 0] and int((counts > 0).sum()) >= 3

    native = copy.deepcopy(torch_layer)
    assert native.gate.pack() and native.pack()
    # The float stacks are dropped for meta tensors of the same shapes (the count stays).
    for name in ("experts_gate_up", "experts_down"):
        dropped, kept = getattr(native, name), getattr(torch_layer, name)
        assert dropped.is_meta and dropped.shape == kept.shape
    for e in range(6):  # the panels hold each expert's weights exactly
        for got, want in zip(native.expert_weights(e), torch_layer.expert_weights(e),
                             strict=True):
            assert torch.equal(got, want)

    silu, down = _counting(monkeypatch, "gemm_silu"), _counting(monkeypatch, "gemm")
    with torch.inference_mode():
        out = native(x)
    with_tokens = [int(n) for n in counts if n > 0]
    assert silu == with_tokens and down == [37, *with_tokens]  # the router's GEMM first
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral_4x_top2", "qwen3_moe_4x_top2"])
def test_loading_in_fp32_puts_the_experts_on_the_native_gemm(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After `load_model` in float32 on CPU every sparse layer is packed; a prompt and decode
    steps run every expert call on `gemm_silu` (none falls back to the float weights), and the
    greedy tokens and logits are transformers'."""
    path, ref = save_checkpoint(CONFIGS[name], tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, moe.SparseMoE)]
    assert layers and all(mlp._gate_up_panels is not None for mlp in layers)
    silu = _counting(monkeypatch, "gemm_silu")
    monkeypatch.setattr(moe.SparseMoE, "expert_weights", lambda *a: pytest.fail("fell back"))
    prompt = [5, 17, 33, 2, 71, 9, 40, 12, 88, 3, 61]
    tokens, logits = greedy(model, prompt, steps=4)
    assert len(silu) >= len(layers) * 5  # each layer, each step: at least one expert
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens])
        ref_logits = ref(ids).logits[0].float()
    torch.testing.assert_close(torch.cat(logits), ref_logits, rtol=1e-4, atol=1e-4)


def test_packing_leaves_a_layer_triton_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton fused MoE taking the layer (the triton backend forced in the interpreter,
    as the GPU-path tests run on CPU), `pack` declines and the float stacks it reads stay."""
    layer = _layer(hidden=32, inter=16, experts=4, seed=2)
    monkeypatch.setattr(moe, "_fused_moe_kernel", lambda device: lambda *args: None)
    assert not layer.pack()
    assert layer._gate_up_panels is None and not layer.experts_gate_up.is_meta
