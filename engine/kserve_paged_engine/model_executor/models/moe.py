"""Mixture-of-experts Llama-family models: Mixtral and Qwen3-MoE.

The attention side is the Llama family's (Qwen3-MoE with its q/k norms); the MLP of a sparse
layer routes each token to its top-k experts (softmax over the router's logits in float32,
top-k, renormalised to sum 1 for Mixtral and for Qwen3-MoE with `norm_topk_prob`) and runs the
experts grouped by expert: tokens are sorted by the expert they picked, so each expert is one
gate/up matmul and one down matmul over all of its tokens, not a loop over tokens. Expert
weights are stacked per layer (`[experts, 2 * inter, hidden]` and `[experts, hidden, inter]`)
and loaded from the checkpoint's per-expert tensors. On CUDA the experts run as one Triton
fused-MoE call (`kernels/kserve_paged_kernels/moe_triton.py`: grouped GEMMs over blocks of one expert's tokens,
routed on the device; also in Triton's interpreter with the triton backend forced); elsewhere
the loop over experts below serves (its per-expert counts are read on the host): on CPU in
float32 each expert on the native packed GEMM (`SparseMoE.pack`), otherwise `F.linear`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_kernels import cpu_native, fused_ops, settings

# Checkpoint expert names -> (our stacked parameter, shard): Mixtral's w1/w3/w2, Qwen3-MoE's
# gate/up/down projections.
_EXPERT_SHARDS = {"w1": "gate", "w3": "up", "w2": "down",
                  "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _fused_moe_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton fused-MoE function on CUDA (and in Triton's interpreter with the triton
    backend forced, as the other fused ops), else None (the torch grouped path). Its routing
    (`kserve_paged_kernels.moe_triton.align_pairs`) stays on the device: no host bincount."""
    module = fused_ops.triton_module("moe_triton", device)
    return None if module is None else module.fused_moe


def routes_on_device(model: nn.Module, device: torch.device) -> bool:
    """Whether `model`'s MoE layers (if any) run on `device` without reading a device value
    back: the fused kernel's routing does; the grouped torch path below reads each expert's
    token count on the host, which a CUDA-graph capture cannot (`capture_graphs` asks)."""
    has_moe = any(isinstance(m, SparseMoE) for m in model.modules())
    return not has_moe or _fused_moe_kernel(device) is not None


class SparseMoE(nn.Module):
    """Router plus stacked SwiGLU experts, computed grouped by expert.

    On CPU in float32 with the native library, `pack()` lays each expert out for the native
    GEMM: gate/up as panel pairs for `gemm_silu` (the SiLU-and-multiply inside the product) and
    down as panels for `gemm`, stacked per layer (`[E, ...]`, one expert a contiguous slice).
    The float stacked weights are then dropped: they become meta tensors of the same shapes,
    so the parameter count (ModelFacts, the planner) stays and their memory goes. The experts
    are nearly all of an MoE model's weights, so keeping both copies would double the model
    (BENCHMARKS.md, "Mixture-of-experts on the native GEMM", has the arithmetic for Mixtral and
    Qwen3-MoE); nothing reads them once packed (the rows are always fp32 rows the GEMM takes,
    and `expert_weights` unpacks one expert from its panels should a call be refused).
    """

    _fused = None  # no fused SwiGLU packing (LlamaForCausalLM.pack_weights, the LoRA manager)
    _gate_up_panels: torch.Tensor | None = None  # [E, 2 * pairs, hidden, P]
    _down_panels: torch.Tensor | None = None  # [E, ceil(hidden / P), inter, P]

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden, inter
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def pack(self) -> bool:
        """Pack the experts for the native GEMM (CPU, float32, library loaded) and drop the
        float stacked weights; True if packed (now or before)."""
        if self._gate_up_panels is not None:
            return True
        gate_up, down = self.experts_gate_up, self.experts_down
        if (gate_up.device.type != "cpu" or gate_up.dtype != torch.float32
                or not settings.onednn_enabled() or not cpu_native.gemm_available()
                or _fused_moe_kernel(gate_up.device) is not None):  # Triton forced: keep floats
            return False
        self._gate_up_panels = _stacked(cpu_native.pack_gate_up_weight, gate_up)
        self._down_panels = _stacked(cpu_native.pack_gemm_weight, down)
        for name in ("experts_gate_up", "experts_down"):
            meta = torch.empty(getattr(self, name).shape, dtype=torch.float32, device="meta")
            setattr(self, name, nn.Parameter(meta, requires_grad=False))
        return True

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s float `[2 * inter, hidden]` gate/up and `[hidden, inter]` down weights
        (unpacked from its panels once packed: a copy)."""
        if self._gate_up_panels is None:
            return self.experts_gate_up[e], self.experts_down[e]
        return (cpu_native.unpack_gate_up_weight(self._gate_up_panels[e], self.intermediate_size),
                cpu_native.unpack_gemm_weight(self._down_panels[e], self.hidden_size))

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
        tokens = order // self.top_k
        # One gather and one weighted scatter for the layer: each expert's rows are a
        # contiguous slice of `rows`, so the loop is only the experts' matmuls.
        rows = x[tokens]
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self._expert(e, rows[start:start + n]))
                start += n
        out = torch.zeros_like(x)
        if ys:
            y = torch.cat(ys) * weights.flatten()[order, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s SwiGLU MLP over its gathered rows: the native GEMMs once packed."""
        if self._gate_up_panels is not None:
            act = cpu_native.gemm_silu(rows, self._gate_up_panels[e], self.intermediate_size)
            if act is not None:
                y = cpu_native.gemm(act, self._down_panels[e], self.hidden_size)
                if y is not None:
                    return y
        gate_up, down = self.expert_weights(e)
        gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)


def _stacked(pack: Callable[[torch.Tensor], torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """`pack` of each expert's weight, stacked `[E, ...]` (one layer's panels at a time)."""
    first = pack(weights[0].detach())
    out = torch.empty((weights.shape[0], *first.shape), dtype=first.dtype)
    out[0] = first
    for e in range(1, weights.shape[0]):
        out[e] = pack(weights[e].detach())
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
        """The stack has no router and no grouped experts. The per-layer path has the experts
        on the native GEMM already; what a stack would still remove is the Python between the
        kernels, measured by bench/probes/moe_step.py (BENCHMARKS.md)."""
        return ("router or grouped experts for sparse (mixture-of-experts) MLPs; their experts "
                "run on the native GEMM per layer (what a stack would still remove: "
                "bench/probes/moe_step.py)")

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


