"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`) and DeepSeek-V2 (`DeepseekV2ForCausalLM`: the
same attention, softmax routing) over the paged latent cache.

The decoder is the Llama family's pre-norm block with DeepSeek's attention (multi-head latent
attention, models/mla.py) and MLP: the first `first_k_dense_replace` layers a dense SwiGLU,
the rest DeepSeek's routed experts with shared experts (models/deepseek_moe.py).

The KV cache holds one latent row per token and layer (`kv_lora_rank + qk_rope_head_dim`
values; kernels/kserve_paged_kernels/mla_reference.py lays it out as one KV head of half that
width in the K and V planes). The model states that shape as its `num_kv_heads` (1) and
`head_dim` (half the latent), which is all the runner, the block manager, the engine's KV
sizing and the planner read (model_facts.py: `kv_latent_dim` says it is a latent), so a latent
block is sized, shared, forked and moved as any other block.

Not here (refused or absent, stated): tensor parallelism (the planner and loader refuse it:
the architecture is not in tp_layout's list), the multi-token-prediction layers
(`num_nextn_predict_layers`: extra checkpoint layers past `num_hidden_layers`, skipped at load),
and CUDA graphs (the attention reads each sequence's length on the host).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.layers import Linear, RMSNorm, SwiGLUMLP
from kserve_paged_engine.model_executor.models.deepseek_moe import DeepseekMoE
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_engine.model_executor.models.mla import MLA_MODES, MLAttention, mla_softmax_scale
from kserve_paged_engine.model_executor.moe_layout import EXPERT_RE, EXPERT_SHARDS
from kserve_paged_engine.model_executor.rope import RotaryEmbedding, rope_parameters
from kserve_paged_kernels import mla_reference
from kserve_paged_kernels.cpu_native import DecoderStack

_BIAS_RE = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate\.e_score_correction_bias$")
# DeepSeek-V3's checkpoint keeps its MTP layer(s) as layers past num_hidden_layers.
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm (the Llama layer's form)."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, scale: float, dense: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, rotary, scale)
        self.mlp: nn.Module = (SwiGLUMLP(config.hidden_size, config.intermediate_size)
                               if dense else DeepseekMoE(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.*` names)."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, scale: float) -> None:
        super().__init__()
        dense = int(config.first_k_dense_replace or 0)
        freq = int(getattr(config, "moe_layer_freq", 1) or 1)  # every freq-th layer routes
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, rotary, scale, dense=i < dense or i % freq != 0)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Paged-latent-cache DeepSeek-V3 causal LM (module docstring)."""

    use_native_stack = False
    native_stack_declined = ("multi-head latent attention and grouped expert routing: the "
                             "stack computes the Llama and Gemma layers only")
    # Read by worker/cuda_graphs.why_eager: the latent attention loops over sequences on the host.
    graph_unsafe = "multi-head latent attention reads each sequence's length on the host"

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu'")
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise ValueError("pretraining_tp > 1 is not supported")
        if getattr(config, "mlp_bias", False):  # DeepSeek-V2's option; its checkpoints have none
            raise ValueError("mlp_bias is not supported for DeepSeek models")
        rope = rope_parameters(config)
        self._read_facts(config, rope)
        # The cache's shape is the latent's (mla_reference.latent_cache_shape), not the heads'.
        self.kv_latent_dim: int = config.kv_lora_rank + config.qk_rope_head_dim
        _, _, _, self.num_kv_heads, self.head_dim = mla_reference.latent_cache_shape(
            1, 1, self.kv_latent_dim)
        self.layout = self.tp = None
        # DeepSeek-V3's multi-token-prediction layers: in the checkpoint, not served (skipped).
        self.num_mtp_layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, self.max_position_embeddings,
                                          rope)
        self.model = DeepseekModel(config, self.rotary_emb, mla_softmax_scale(config, rope))
        self.classifies = False
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def set_mla_mode(self, mode: str) -> None:
        """Every layer's attention path: "auto" (the cheaper per sequence), "absorbed" or
        "expanded" (tests and bench/bench_mla.py compare them)."""
        if mode not in MLA_MODES:
            raise ValueError(f"MLA mode must be one of {', '.join(MLA_MODES)} (got {mode!r})")
        for layer in self.model.layers:
            layer.self_attn.mode = mode

    def native_stack_unsupported(self) -> str | None:
        return self.native_stack_declined

    def _build_native_stack(self) -> DecoderStack | None:
        return None

    def materialize(self, device: torch.device) -> None:
        """As the Llama family's, and the routers' score biases zeroed (buffers `to_empty`
        leaves uninitialised; a checkpoint's values replace them at load)."""
        super().materialize(device)
        for layer in self.model.layers:
            bias = getattr(layer.mlp, "e_score_correction_bias", None)
            if bias is not None:
                bias.zero_()

    def expected_weights(self) -> set[str]:
        names: set[str] = set()
        for name in super().expected_weights():
            m = re.match(r"^(model\.layers\.\d+\.mlp)\.(experts_gate_up|experts_down)$", name)
            if m is None:
                names.add(name)
                continue
            base, what = m.groups()
            shards = ("gate", "up") if what == "experts_gate_up" else ("down",)
            experts = self.get_submodule(base).num_experts
            names.update(f"{base}.experts.{e}.{s}_proj.weight"
                         for e in range(experts) for s in shards)
        for i, layer in enumerate(self.model.layers):
            if getattr(layer.mlp, "e_score_correction_bias", None) is not None:
                names.add(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        return names

    def load_weights(self, weights: Any) -> None:
        """transformers' names in; the `num_nextn_predict_layers` MTP layers past
        `num_hidden_layers` left out (a layer past those is still an unexpected tensor)."""
        mtp = self.num_mtp_layers

        def decoder_only() -> Any:
            for name, tensor in weights:
                m = _LAYER_RE.match(name)
                if m is None or not self.num_layers <= int(m.group(1)) < self.num_layers + mtp:
                    yield name, tensor

        super().load_weights(decoder_only())

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        m = EXPERT_RE.match(hf_name)
        if m is not None:
            layer, expert, shard = m.group(1), int(m.group(2)), EXPERT_SHARDS[m.group(3)]
            if shard == "down":
                return params[f"{layer}.mlp.experts_down"][expert]
            stacked = params[f"{layer}.mlp.experts_gate_up"][expert]
            inter = stacked.shape[0] // 2
            return stacked.narrow(0, 0 if shard == "gate" else inter, inter)
        m = _BIAS_RE.match(hf_name)
        if m is not None:
            return self.get_buffer(f"{m.group(1)}.e_score_correction_bias")
        if hf_name.endswith(".self_attn.q_proj.weight"):  # not a fused qkv here
            return params[hf_name]
        return super()._target(hf_name, params)
