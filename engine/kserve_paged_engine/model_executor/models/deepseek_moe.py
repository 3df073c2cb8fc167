"""DeepSeek-V3's mixture of experts: sigmoid scores, group-limited top-k, shared experts (and
DeepSeek-V2's softmax routing, `_route_v2`).

The routed experts are the MoE layer of models/moe.py (stacked, grouped by expert, the native
GEMM or the Triton fused kernel); what differs is the routing and the always-on shared experts:

- scores are the sigmoid of the router's logits (float32); a learned per-expert bias
  (`e_score_correction_bias`) is added for the choice only, never to the weights;
- the experts are split into `n_group` groups; a group's score is the sum of its two best
  biased scores, only the `topk_group` best groups stay eligible, and the top-k experts are
  picked among theirs;
- the picked experts' (unbiased) scores are renormalised to sum 1 with `norm_topk_prob`, then
  multiplied by `routed_scaling_factor`;
- `n_shared_experts` experts (one SwiGLU MLP of `n_shared * moe_intermediate_size`) see every
  token and add to the routed output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kserve_paged_engine.model_executor.layers import SwiGLUMLP
from kserve_paged_engine.model_executor.models.moe import SparseMoE


class DeepseekMoE(SparseMoE):
    """Routed experts with DeepSeek-V3's routing (module docstring) plus the shared experts."""

    def __init__(self, config: Any) -> None:
        # The routing a checkpoint was trained with, by its own names: V3's sigmoid scores with
        # bias-corrected group top-k (`noaux_tc`), V2's softmax with plain (`greedy`) or
        # group-limited (`group_limited_greedy`) top-k.
        self.v2 = getattr(config, "model_type", None) == "deepseek_v2"
        scoring = getattr(config, "scoring_func", "softmax" if self.v2 else "sigmoid")
        method = getattr(config, "topk_method", None) or ("greedy" if self.v2 else "noaux_tc")
        allowed = ({("softmax", "greedy"), ("softmax", "group_limited_greedy")} if self.v2
                   else {("sigmoid", "noaux_tc")})
        if (scoring, method) not in allowed:
            raise ValueError(f"unsupported DeepSeek routing: scoring_func {scoring!r}, "
                             f"topk_method {method!r} (supported: {sorted(allowed)})")
        self.group_limited = method != "greedy"
        num_experts = config.n_routed_experts
        super().__init__(config.hidden_size, config.moe_intermediate_size, num_experts,
                         config.num_experts_per_tok, bool(config.norm_topk_prob))
        self.num_groups = int(config.n_group or 1)
        self.topk_group = int(config.topk_group or self.num_groups)
        if num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts ({num_experts}) must be a multiple of n_group "
                             f"({self.num_groups})")
        if self.topk_group > self.num_groups:
            raise ValueError(f"topk_group ({self.topk_group}) > n_group ({self.num_groups})")
        if self.top_k > self.topk_group * (num_experts // self.num_groups):
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of "
                             f"topk_group ({self.topk_group}) groups")
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.v2:  # no score bias in V2
            self.e_score_correction_bias: torch.Tensor | None = None
        else:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, dtype=torch.float32))
        shared = int(config.n_shared_experts or 0)
        self.shared_experts = (SwiGLUMLP(config.hidden_size,
                                         config.moe_intermediate_size * shared)
                               if shared else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # In float32, as transformers routes; a router `--quantization` quantized has no
        # float weight left, so its own product.
        logits = (F.linear(x.float(), self.gate.weight.float()) if self.gate.quant is None
                  else self.gate(x).float())  # [T, E]
        if self.e_score_correction_bias is None:
            return self._route_v2(torch.softmax(logits, dim=-1))
        scores = torch.sigmoid(logits)
        biased = scores + self.e_score_correction_bias.float()
        per_group = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
        eligible = group_mask.unsqueeze(-1).expand_as(per_group).reshape_as(biased)
        experts = biased.masked_fill(~eligible, float("-inf")).topk(
            self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    def _route_v2(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2: top-k of the softmax scores (group-limited: among the `topk_group`
        groups of the highest single score), times `routed_scaling_factor`; not renormalised
        (transformers' DeepSeek-V2 ignores `norm_topk_prob`, and V2's checkpoints leave it
        false)."""
        if self.group_limited:
            per_group = scores.view(-1, self.num_groups, self.num_experts // self.num_groups)
            best = per_group.max(dim=-1).values.topk(self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros(per_group.shape[:2], device=scores.device).scatter_(1, best, 1.0)
            keep = mask.bool().unsqueeze(-1).expand_as(per_group).reshape_as(scores)
            scores = scores.masked_fill(~keep, 0.0)
        weights, experts = scores.topk(self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(x)

    def pack(self) -> bool:
        """The routed experts' packing (SparseMoE) and the shared MLP's fused gate/up."""
        if self.shared_experts is not None:
            self.shared_experts.pack()
        return super().pack()
