"""gpt-oss (transformers' `GptOssForCausalLM`) over the paged KV cache.

What differs from the Llama family, all as transformers computes it: every attention layer has
a learned sink logit per query head that joins the softmax's denominator (`Attention(sinks=
True)`; each kernel adds `exp(sink)`); layers alternate between a sliding window and full
attention (`layer_types`, through the KV groups as Gemma's); q/k/v/o carry biases; YaRN RoPE;
and every MLP is a mixture of experts whose router has a bias, whose experts have biases, and
whose SwiGLU is clamped: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
`(up + 1) * gate * sigmoid(alpha * gate)`, with the gate and up columns interleaved. The router
takes the top-k logits and softmaxes only those.

Experts come either as float (the layout transformers saves: `gate_up_proj` `[E, hidden,
2 * inter]`, `down_proj` `[E, inter, hidden]`, used as `x @ W`) or as MXFP4 (the released
checkpoints: `*_blocks` / `*_scales`, rows of `W.T`), which stay 4-bit in memory: each
expert's matmuls decode the weight inside their loop (`kserve_paged_kernels.mxfp4.linear`: the
native CPU kernel, the Triton kernel on CUDA), so no float copy of an expert is ever made.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_kernels import mxfp4

_SINK_RE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(attn\.)?sinks$")


def is_mxfp4(config: Any) -> bool:
    """Whether the config's checkpoint stores the experts as MXFP4 (`quant_method: mxfp4`)."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(method or "").lower() == "mxfp4"


class GptOssExperts(nn.Module):
    """Router plus biased experts with the clamped SwiGLU, computed grouped by expert (tokens
    sorted by the expert they picked: one matmul pair per expert over all of its tokens)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, alpha: float,
                 limit: float, mxfp4_experts: bool) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden, inter
        self.num_experts, self.top_k = num_experts, top_k
        self.alpha, self.limit = alpha, limit
        self.mxfp4 = mxfp4_experts
        self.router = Linear(hidden, num_experts, bias=True)
        self.experts = nn.Module()  # transformers' `mlp.experts.*` names
        ex = self.experts
        if mxfp4_experts:
            if hidden % mxfp4.GROUP or inter % mxfp4.GROUP:
                raise ValueError(f"MXFP4 experts need hidden ({hidden}) and intermediate "
                                 f"({inter}) sizes that are multiples of {mxfp4.GROUP}")
            u8 = {"dtype": torch.uint8}
            ex.gate_up_proj_blocks = nn.Parameter(
                torch.empty(num_experts, 2 * inter, hidden // 32, 16, **u8), requires_grad=False)
            ex.gate_up_proj_scales = nn.Parameter(
                torch.empty(num_experts, 2 * inter, hidden // 32, **u8), requires_grad=False)
            ex.down_proj_blocks = nn.Parameter(
                torch.empty(num_experts, hidden, inter // 32, 16, **u8), requires_grad=False)
            ex.down_proj_scales = nn.Parameter(
                torch.empty(num_experts, hidden, inter // 32, **u8), requires_grad=False)
        else:
            ex.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
            ex.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        ex.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        ex.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def pack(self) -> bool:
        """Nothing to pack: the experts run on torch matmuls (the router, a `Linear`, is packed
        with the model's projections)."""
        return False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) `[T, top_k]`: the top-k router logits, softmaxed among themselves
        in the logits' dtype (transformers' order)."""
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU over interleaved gate (even) and up (odd) columns."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        rows = x[tokens]
        ex = self.experts
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            r = rows[start:start + n]
            if self.mxfp4:  # 4-bit weights decoded inside the matmul (kernels' mxfp4.linear)
                h = self.swiglu(mxfp4.linear(r, ex.gate_up_proj_blocks[e],
                                             ex.gate_up_proj_scales[e], ex.gate_up_proj_bias[e]))
                y = mxfp4.linear(h, ex.down_proj_blocks[e], ex.down_proj_scales[e],
                                 ex.down_proj_bias[e])
            else:
                h = self.swiglu(r @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e])
                y = h @ ex.down_proj[e] + ex.down_proj_bias[e]
            w = weights.flatten()[order[start:start + n], None]
            out.index_add_(0, tokens[start:start + n], (y * w).to(out.dtype))
            start += n
        return out


class GptOssForCausalLM(LlamaForCausalLM):
    """Paged-cache gpt-oss: the Llama family's attention (biased q/k/v/o, YaRN through the
    shared RoPE, windows from `layer_types`) with sinks, and `GptOssExperts` for every MLP."""

    use_native_stack = False
    # CUDA graphs (worker/cuda_graphs.py): the experts' loop reads its token counts on the host.
    graph_unsafe = "gpt-oss's experts count their tokens on the host (no fused MoE kernel)"

    def __init__(self, config: Any, tp: TPRanks | None = None) -> None:
        if tp is not None:
            raise ValueError("gpt-oss under tensor parallelism is not supported yet "
                             "(tensor_parallel_size 1)")
        super().__init__(config)
        mx = is_mxfp4(config)
        for layer in self.model.layers:
            layer.self_attn.attn.add_sinks()
            layer.mlp = GptOssExperts(
                config.hidden_size, config.intermediate_size, config.num_local_experts,
                config.num_experts_per_tok, float(config.swiglu_alpha),
                float(config.swiglu_limit), mx)

    def native_stack_unsupported(self) -> str | None:
        return ("attention sinks and biased, clamped-SwiGLU experts (gpt-oss); the layers run "
                "one by one")

    def expected_weights(self) -> set[str]:
        names = set()
        for name in super().expected_weights():
            m = _SINK_RE.match(name)
            names.add(f"{m.group(1)}.sinks" if m else name)
        return names

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        m = _SINK_RE.match(hf_name)
        if m:
            return params[f"{m.group(1)}.attn.sinks"]
        return super()._target(hf_name, params)
