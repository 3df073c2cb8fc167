"""Mixture-of-experts Llama-family models: Mixtral and Qwen3-MoE.

The attention side is the Llama family's (Qwen3-MoE with its q/k norms); the MLP of a sparse
layer routes each token to its top-k experts (softmax over the router's logits in float32,
top-k, renormalised to sum 1 for Mixtral and for Qwen3-MoE with `norm_topk_prob`) and runs the
experts grouped by expert: tokens are sorted by the expert they picked, so each expert is one
gate/up matmul and one down matmul over all of its tokens, not a loop over tokens. Expert
weights are stacked per layer (`[experts, 2 * inter, hidden]` and `[experts, hidden, inter]`)
and loaded from the checkpoint's per-expert tensors. On CUDA the experts run as one Triton
fused-MoE call (`kernels/moe_triton.py`: grouped GEMMs over blocks of one expert's tokens,
routed on the device; also in Triton's interpreter with the triton backend forced); elsewhere
the torch loop over experts below serves (its per-expert counts are read on the host).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_executor.layers import Linear
from engine.model_executor.models.llama import LlamaForCausalLM
from kernels import fused_ops

# Checkpoint expert names -> (our stacked parameter, shard): Mixtral's w1/w3/w2, Qwen3-MoE's
# gate/up/down projections.
_EXPERT_SHARDS = {"w1": "gate", "w3": "up", "w2": "down",
                  "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _fused_moe_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton fused-MoE function on CUDA (and in Triton's interpreter with the triton
    backend forced, as the other fused ops), else None (the torch grouped path). Its routing
    (`kernels.moe_triton.align_pairs`) stays on the device: no host bincount."""
    module = fused_ops.triton_module("moe_triton", device)
    return None if module is None else module.fused_moe


class SparseMoE(nn.Module):
    """Router plus stacked SwiGLU experts, computed grouped by expert."""

    _fused = None  # no native gate/up packing (LlamaForCausalLM.pack_weights asks)

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = inter
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def pack(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        fused = _fused_moe_kernel(x.device)
        if fused is not None:
            return fused(x, self.experts_gate_up, self.experts_down, weights, experts)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // self.top_k
            gate, up = F.linear(x[tokens], self.experts_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[e])
            out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(out.dtype))
        return out


def _sparse_layers(config: Any) -> list[bool]:
    """Which layers route to experts: all of Mixtral's; Qwen3-MoE's every
    `decoder_sparse_step`-th outside `mlp_only_layers`."""
    n = config.num_hidden_layers
    if getattr(config, "model_type", None) == "mixtral":
        return [True] * n
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    experts = getattr(config, "num_experts", 0) or 0
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE: the Llama family's model with sparse MLPs where the config says."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        mixtral = config.model_type == "mixtral"
        num_experts = config.num_local_experts if mixtral else config.num_experts
        inter = config.intermediate_size if mixtral else config.moe_intermediate_size
        renormalize = True if mixtral else bool(getattr(config, "norm_topk_prob", False))
        self.mlp_prefix = "block_sparse_moe" if mixtral else "mlp"
        self.sparse_layers = _sparse_layers(config)
        for layer, sparse in zip(self.model.layers, self.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoE(config.hidden_size, inter, num_experts,
                                      config.num_experts_per_tok, renormalize)
        self.use_native_stack = False

    def native_stack_unsupported(self) -> str | None:
        return "sparse (mixture-of-experts) MLPs"

    def expected_weights(self) -> set[str]:
        names: set[str] = set()
        for name in super().expected_weights():
            m = re.match(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts_gate_up|"
                         r"experts_down)$", name)
            if m is None:
                names.add(name)
                continue
            layer, what = m.groups()
            base = f"{layer}.{self.mlp_prefix}"
            if what == "gate.weight":
                names.add(f"{base}.gate.weight")
                continue
            mlp = self.get_submodule(f"{layer}.mlp")
            shards = ("gate", "up") if what == "experts_gate_up" else ("down",)
            for e in range(mlp.num_experts):
                names.update(f"{base}.experts.{e}.{self._expert_name(s)}.weight" for s in shards)
        return names

    def _expert_name(self, shard: str) -> str:
        if self.mlp_prefix == "block_sparse_moe":
            return {"gate": "w1", "up": "w3", "down": "w2"}[shard]
        return f"{shard}_proj"

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        m = _EXPERT_RE.match(hf_name)
        if m is not None:
            layer, expert, which = m.group(1), int(m.group(2)), m.group(3)
            shard = _EXPERT_SHARDS[which]
            if shard == "down":
                return params[f"{layer}.mlp.experts_down"][expert]
            stacked = params[f"{layer}.mlp.experts_gate_up"][expert]
            inter = stacked.shape[0] // 2
            return stacked.narrow(0, 0 if shard == "gate" else inter, inter)
        if self.mlp_prefix == "block_sparse_moe" and ".block_sparse_moe.gate." in hf_name:
            return params[hf_name.replace(".block_sparse_moe.", ".mlp.")]
        return super()._target(hf_name, params)


