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
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.expert_parallel import ExpertDispatch
from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_engine.model_executor.moe_layout import (
    EXPERT_RE,
    EXPERT_SHARDS,
    ExpertLayout,
    moe_sizes,
)
from kserve_paged_kernels import cpu_native, fused_ops, settings

# Checkpoint expert names -> the shard of our stacked parameters each fills (Mixtral's
# w1/w3/w2, Qwen3-MoE's gate/up/down projections): defined in moe_layout.py, which the
# loader's tensor-parallel cuts read too; these names are the ones models/deepseek.py imports.
_EXPERT_RE, _EXPERT_SHARDS = EXPERT_RE, EXPERT_SHARDS


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
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    return not moe or (_fused_moe_kernel(device) is not None  # expert parallelism: host splits
                       and all(m.dispatch is None for m in moe))


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
                 renormalize: bool, tp: TPRanks | None = None,
                 experts: tuple[int, int] | None = None, expert_parallel: bool = False) -> None:
        """Under tensor parallelism (`tp`), `inter` is this rank's cut of each expert and
        `experts` the (first, count) it holds (moe_layout.py); the router sees them all."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.first_expert, self.num_local_experts = experts or (0, num_experts)
        self.hidden_size, self.intermediate_size = hidden, inter
        self.tp = tp
        self.dispatch = (ExpertDispatch(tp, num_experts) if tp is not None and expert_parallel
                         else None)
        self.gate = Linear(hidden, num_experts, bias=False)
        local = self.num_local_experts
        self.experts_gate_up = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(local, hidden, inter))

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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert weights and experts `[T, top_k]`: softmax over the router's
        logits in float32, top-k, renormalised where the family does (DeepSeek's sigmoid,
        group-limited routing overrides this: models/deepseek_moe.py)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.dispatch is not None:  # expert parallelism: to the owners and back
            return self.dispatch(x, weights, experts, self._owned)
        out = self._experts_sum(x, weights, experts)
        return out if self.tp is None else self.tp.all_reduce(out)  # cut experts: partial sums

    def _owned(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's owner side: each row through its one local expert, unweighted
        (the sender weights it)."""
        ones = torch.ones(rows.shape[0], 1, device=rows.device)
        return self._experts_sum(rows, ones, local_ids[:, None])

    def _experts_sum(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                     ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]), experts `[T, k]` numbered from
        this rank's first."""
        fused = _fused_moe_kernel(x.device)
        if fused is not None:
            return fused(x, self.experts_gate_up, self.experts_down, weights, experts)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_local_experts).tolist()
        tokens = order // experts.shape[1]
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


def _stacked(pack: Callable[..., torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """`pack` of each expert's weight, stacked `[E, ...]` (one layer's panels at a time) on
    huge pages; each expert's own pack only a step (off the arena, which never reuses space)."""
    first = pack(weights[0].detach(), huge_pages=False)
    out = torch.empty((weights.shape[0], *first.shape), dtype=first.dtype)
    out[0] = first
    for e in range(1, weights.shape[0]):
        out[e] = pack(weights[e].detach(), huge_pages=False)
    return cpu_native.on_huge_pages(out)


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

    def __init__(self, config: Any, tp: TPRanks | None = None,
                 expert_parallel: bool = False) -> None:
        """`expert_parallel` spreads whole experts over `tp`'s ranks instead of cutting each
        (moe_layout.py); without `tp` it changes nothing (one rank holds every expert)."""
        super().__init__(config, tp)
        mixtral = config.model_type == "mixtral"
        num_experts, inter = moe_sizes(config)
        experts = None
        if tp is not None:
            shard = ExpertLayout.of(config, tp.rank, tp.world_size, expert_parallel)
            experts, inter = shard.experts, shard.intermediate[1]
        renormalize = True if mixtral else bool(getattr(config, "norm_topk_prob", False))
        self.mlp_prefix = "block_sparse_moe" if mixtral else "mlp"
        self.sparse_layers = _sparse_layers(config)
        for layer, sparse in zip(self.model.layers, self.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoE(config.hidden_size, inter, num_experts,
                                      config.num_experts_per_tok, renormalize, tp, experts,
                                      expert_parallel)
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
            for e in range(mlp.first_expert, mlp.first_expert + mlp.num_local_experts):
                names.update(f"{base}.experts.{e}.{self._expert_name(s)}.weight" for s in shards)
        return names

    def _expert_name(self, shard: str) -> str:
        if self.mlp_prefix == "block_sparse_moe":
            return {"gate": "w1", "up": "w3", "down": "w2"}[shard]
        return f"{shard}_proj"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As the Llama family's, without the experts other ranks own (expert parallelism:
        the loader read nothing of them)."""
        super().load_weights(item for item in weights if self._holds(item[0]))

    def _holds(self, hf_name: str) -> bool:
        m = EXPERT_RE.match(hf_name)
        if m is None:
            return True
        mlp = self.get_submodule(f"{m.group(1)}.mlp")
        return 0 <= int(m.group(2)) - mlp.first_expert < mlp.num_local_experts

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        m = EXPERT_RE.match(hf_name)
        if m is not None:
            layer, which = m.group(1), m.group(3)
            expert = int(m.group(2)) - self.get_submodule(f"{layer}.mlp").first_expert
            shard = EXPERT_SHARDS[which]
            if shard == "down":
                return params[f"{layer}.mlp.experts_down"][expert]
            stacked = params[f"{layer}.mlp.experts_gate_up"][expert]
            inter = stacked.shape[0] // 2
            return stacked.narrow(0, 0 if shard == "gate" else inter, inter)
        if self.mlp_prefix == "block_sparse_moe" and ".block_sparse_moe.gate." in hf_name:
            return params[hf_name.replace(".block_sparse_moe.", ".mlp.")]
        return super()._target(hf_name, params)


