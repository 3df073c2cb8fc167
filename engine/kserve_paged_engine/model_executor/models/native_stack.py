"""The one-call native decoder stack of a Llama-family or Gemma model
(kernels/kserve_paged_kernels/csrc/decoder_stack.c): whether a model's layers can take it, and its per-layer weights
as `DecoderStack` reads them (float32 panels or bf16 pairs, either with weight-only quantized
projections)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kserve_paged_engine.model_executor.layers import Linear, SwiGLUMLP
from kserve_paged_kernels import cpu_native, quant_linear

logger = logging.getLogger("kserve_paged_engine")


def _stack_ready(mlp: nn.Module, linear: Linear) -> bool:
    """Whether the native decoder stack runs this projection: fp32 panels (gate/up as the MLP's
    panel pairs) or a weight on our quantized kernel."""
    if linear.quant is not None:
        return getattr(linear.quant, "kernel", None) == "native"  # Triton weights: no
    return mlp._fused is not None if linear is mlp.gate_up_proj else linear._native


def _stack_weight(linear: Linear, key: str, formats: dict[str, tuple[int, int]]
                  ) -> dict[str, torch.Tensor | None]:
    """`{key}_w` and `{key}_b` for the stack; a quantized weight's (bits, group) to `formats`."""
    quant = linear.quant
    if quant is not None:
        formats[f"{key}_w"] = (quant_linear.bits_of(quant), quant.group_size)
    return {f"{key}_w": linear._packed if quant is None else quant.packed,
            f"{key}_b": None if linear.bias is None else linear.bias.detach()}


def _bf16_ready(linear: Linear) -> bool:
    """Whether the bf16 stack runs this projection: bf16 pairs, or a weight on our quantized
    kernel (with bf16 activations where `cpu_native.native_bf16_quant()`; an even group)."""
    quant = linear.quant
    if quant is None:
        return linear._bf16_native
    return getattr(quant, "kernel", None) == "native" and quant.group_size % 2 == 0


def layer_norms(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    """A layer's norm weights under the stack's names, each as the native kernel multiplies by
    it (None: a norm it does not compute): Llama's two, or Gemma's four (the norms of the
    attention and MLP outputs besides; its MLP input norm is `post_norm`)."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's sandwich
        norms = {"in_norm": layer.input_layernorm,
                 "attn_out_norm": layer.post_attention_layernorm,
                 "post_norm": layer.pre_feedforward_layernorm,
                 "mlp_out_norm": layer.post_feedforward_layernorm}
    else:
        norms = {"in_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm}
    weights = {key: norm.native_weight() for key, norm in norms.items()}
    return {key: None if w is None else w.detach() for key, w in weights.items()}


def attention_declined(layers: list[nn.Module]) -> str | None:
    """Why the stack cannot take these layers' attention and MLP settings, or None: it holds one
    scale and soft cap for every layer, and no GELU after a quantized gate/up."""
    attns = [layer.self_attn.attn for layer in layers]
    if len({(a.scale, a.softcap or 0.0) for a in attns}) > 1:
        return "attention scales or soft caps that differ between layers"
    if any(getattr(layer.mlp, "gelu", False) and layer.mlp.gate_up_proj.quant is not None
           for layer in layers):
        return "GeGLU after a quantized gate/up (no native GELU-and-multiply there)"
    if any(None in layer_norms(layer).values() for layer in layers):
        return "a norm the native kernels do not compute"
    return None


def projections_declined(model: Any, layers: list[nn.Module], bf16: bool) -> str | None:
    """Why the stack cannot take these layers, or None. bf16 needs every projection on the
    native bf16 GEMM or the native quantized kernel, and attention its one region runs (no
    window, a head dim the bf16 prefill tiles take)."""
    if not bf16:
        if not all(_stack_ready(layer.mlp, m) for layer in layers for m in layer.modules()
                   if isinstance(m, Linear)):
            return "a projection is not on the native GEMM"
        return None
    if any(not isinstance(layer.mlp, SwiGLUMLP) for layer in layers):
        return "a sparse (mixture-of-experts) MLP in bf16"
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
    if not linears or not all(_bf16_ready(m) for m in linears):
        return "a projection is not on the native bf16 GEMM or quantized kernel"
    if any(hasattr(layer, "pre_feedforward_layernorm") for layer in layers):
        return "Gemma's layer in bf16 (its norms, GELU and soft cap are fp32 only)"
    if any(layer.self_attn.q_norm is not None for layer in layers):
        return "q/k norm in bf16"
    if any(layer.self_attn.attn.window for layer in layers):
        return "sliding windows in bf16 (the bf16 stack's region attends without windows)"
    if not cpu_native.bf16_prefill_tiles(model.head_dim):
        return (f"head dim {model.head_dim} in bf16 (the bf16 stack's region needs the prefill "
                "tiles: head dims 64 and 128)")
    return None


def build_native_stack(model: Any) -> cpu_native.DecoderStack | None:
    """The model's one-call native decoder stack, or None with `model.native_stack_declined`
    saying why (logged)."""
    model.native_stack_declined = model.native_stack_unsupported()
    if model.native_stack_declined is not None:
        logger.info("decoder stack stays on per-layer modules: the native stack has no %s",
                    model.native_stack_declined)
        return None
    layers = list(model.model.layers)
    bf16 = model.model.norm.weight.dtype == torch.bfloat16
    model.native_stack_declined = (projections_declined(model, layers, bf16)
                                   or attention_declined(layers))
    if model.native_stack_declined is not None:
        logger.info("decoder stack stays on per-layer modules: %s", model.native_stack_declined)
        return None
    eps = model.model.norm.eps
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        formats: dict[str, tuple[int, int]] = {}
        gate_up = ({"gate_up_w": mlp._fused, "gate_up_b": mlp._fused_bias}
                   if not bf16 and mlp._fused is not None
                   else _stack_weight(mlp.gate_up_proj, "gate_up", formats))
        weights.append({**gate_up,
            **({} if attn.q_norm is None else {"q_norm": attn.q_norm.native_weight().detach(),
                                               "k_norm": attn.k_norm.native_weight().detach()}),
            **layer_norms(layer),
            **_stack_weight(attn.qkv_proj, "qkv", formats),
            **_stack_weight(attn.o_proj, "o", formats),
            **_stack_weight(mlp.down_proj, "down", formats),
            "formats": formats})
    rotaries = [layer.self_attn.rotary[0] for layer in layers]
    tables = (None if all(r is model.rotary_emb for r in rotaries)
              else [(r.cos, r.sin) for r in rotaries])  # Gemma 3's local layers
    try:
        return cpu_native.DecoderStack(
            weights, model.model.norm.native_weight().detach(), model.rotary_emb.cos,
            model.rotary_emb.sin, hidden=model.hidden_size, heads=model.num_heads,
            kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            inter=layers[0].mlp.intermediate_size, eps=eps,
            scale=layers[0].self_attn.attn.scale,
            windows=[layer.self_attn.attn.window for layer in layers],
            gelu=layers[0].mlp.gelu, softcap=layers[0].self_attn.attn.softcap,
            layer_tables=tables)
    except ValueError as exc:
        model.native_stack_declined = str(exc)
        logger.info("decoder stack stays on per-layer modules: %s", exc)
        return None
