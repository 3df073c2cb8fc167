"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

What differs from the Llama family, all from the checkpoint's config: the embedding is scaled
by sqrt(hidden_size); RMSNorm multiplies by (1 + weight); every block norms the attention and
MLP outputs too (pre and post norms); the MLP is GeGLU (tanh GELU); the attention scale is
`query_pre_attn_scalar ** -0.5`; layers alternate between sliding-window (`layer_types`) and
global attention. Gemma 2 soft-caps the attention scores; both soft-cap the final logits.
Gemma 3 norms each head of q and k (like Qwen3) and gives its local layers their own RoPE base.
Projections, attention and weight loading are the Llama family's (`engine/kserve_paged_engine/model_executor/models/llama.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.layers import Linear, RMSNorm, SwiGLUMLP
from kserve_paged_engine.model_executor.models.architectures import architecture_of
from kserve_paged_engine.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
)
from kserve_paged_engine.model_executor.rope import RotaryEmbedding, rope_parameters
from kserve_paged_kernels import cpu_native, fused_ops


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times (1 + weight), in float32 and cast back after the multiply (transformers'
    Gemma order). The checkpoint stores the offset weight, which is what `weight` holds; once
    `pack()`ed on CPU (float32 or bfloat16), `1 + weight` is kept in float32 for the native
    kernels, which compute exactly this order (`w * (x * inv)`, rounded once:
    `cpu_native.gemma_add_rms_norm`)."""

    offset_weight: torch.Tensor | None = None

    def pack(self) -> bool:
        """Keep `1 + weight` in float32 for the native kernels (float32 or bfloat16 on CPU; call
        after the weights are final, as `Linear.pack`); True if kept."""
        w = self.weight
        native = w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
        self.offset_weight = (1.0 + w.detach().float()).contiguous() if native else None
        return native

    def native_weight(self) -> torch.Tensor | None:
        return self.offset_weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)` (fused natively
        on CPU float32 and bfloat16 and on CUDA, the residual updated in place)."""
        if x.dim() == 2 and not torch.is_grad_enabled():
            offset = self.offset_weight
            fused = (None if offset is None
                     else cpu_native.gemma_add_rms_norm(x, residual, offset, self.eps))
            if fused is None:
                fused = fused_ops.add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
            if fused is not None:
                return fused if residual is None else (fused, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaAttention(LlamaAttention):
    """The Llama family's attention whose Gemma 3 q/k norm runs natively in place on the fused
    qkv rows in bfloat16 too (Gemma's rounding: `cpu_native.gemma_qk_norm_inplace`), so RoPE
    then runs natively there as well."""

    qk_norm_kernel = "gemma_qk_norm_inplace"


class GeGLUMLP(SwiGLUMLP):
    """`down(gelu_tanh(gate(x)) * up(x))`, gate and up fused into one matmul; once `pack()`ed
    on the native GEMM, the GELU-and-multiply inside that GEMM (`cpu_native.gemm_gelu`); in
    bfloat16 on CPU one native pass after it (`fused_ops.act_mul`: `cpu_native.gelu_mul`)."""

    gelu = True

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size, bias=False)


class GemmaDecoderLayer(nn.Module):
    """Sandwich block: norm, attention, norm, residual add; norm, MLP, norm, residual add."""

    def __init__(self, config: Any, head_dim: int, rotary: RotaryEmbedding, window: int | None,
                 attn_softcap: float | None, qk_norm: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))  # q/k/v and o alike
        self.self_attn = GemmaAttention(
            config, head_dim, rotary, bias, bias, qk_norm, window=window,
            softcap=attn_softcap, scale=float(config.query_pre_attn_scalar) ** -0.5,
            norm=GemmaRMSNorm)
        self.mlp = GeGLUMLP(h, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(post-normed MLP output, residual stream)`: the stream's add is fused into the next
        norm, as in the Llama layer (`residual` None in the first layer: `x` is the stream)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.*` names)."""

    def __init__(self, config: Any, layers: list[GemmaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Paged-cache Gemma 2 / Gemma 3 causal LM; loading, ties and logits rows as the Llama
    family's (the checkpoint names are the same)."""

    ties_by_default = True  # Gemma's configs tie the LM head unless they say otherwise

    def __init__(self, config: Any, tp: TPRanks | None = None) -> None:
        nn.Module.__init__(self)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r}; only 'gelu_pytorch_tanh'")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (an encoder) is not supported")
        gemma3 = architecture_of(config) == "Gemma3ForCausalLM"
        # Gemma 3: local (sliding) layers rotate with their own base; Gemma 2 shares one table.
        global_rope = rope_parameters(config, "full_attention" if gemma3 else None)
        self._read_facts(config, global_rope)  # the facts the Llama family reads alike
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        # transformers' Gemma 3 attention ignores attn_logit_softcapping; Gemma 2 applies it.
        attn_softcap = None if gemma3 else getattr(config, "attn_logit_softcapping", None)
        # Tensor parallelism: this rank's heads and MLP columns, as the Llama family's.
        layer_config = self._tp_config(config, tp)

        self.rotary_emb = RotaryEmbedding(self.head_dim, self.max_position_embeddings,
                                          global_rope)
        self.local_rotary_emb = (
            RotaryEmbedding(self.head_dim, self.max_position_embeddings,
                            rope_parameters(config, "sliding_attention")) if gemma3 else None)
        layers = []
        for window in self.layer_windows:
            local = window is not None and self.local_rotary_emb is not None
            rotary = self.local_rotary_emb if local else self.rotary_emb
            layers.append(GemmaDecoderLayer(layer_config, self.head_dim, rotary, window,
                                            attn_softcap, qk_norm=gemma3))
        self.model = GemmaModel(config, layers)
        self.lm_head = Linear(self.hidden_size, self.vocab_size, bias=False)
        if tp is not None:
            bias = bool(getattr(config, "attention_bias", False))
            self._shard_modules(tp, o_bias=bias, mlp_bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions `[T]` (all sequences' new tokens) -> hidden `[T, hidden_size]`."""
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) in the weights' dtype, as transformers rounds it.
        x = x * torch.tensor(self.hidden_size ** 0.5, dtype=x.dtype)
        return self._decode(x, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden `[N, hidden_size]` -> float32 logits `[N, vocab_size]`, soft-capped (under
        tensor parallelism on rank 0, after the gather; the others get None)."""
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def pack_weights(self) -> int:
        """Pre-pack every projection for the CPU matmul kernels, the MLP's gate/up as panel
        pairs for `gemm_gelu`, each norm's `1 + weight`, then the native decoder stack as the
        Llama family's (fp32: Gemma's layer is one of the stack's)."""
        packed = sum(m.pack() for m in self.modules() if isinstance(m, Linear))
        for layer in self.model.layers:
            layer.mlp.pack()
        for norm in self.modules():
            if isinstance(norm, GemmaRMSNorm):
                norm.pack()
        self.native_stack = self._build_native_stack()
        return packed

    def materialize(self, device: torch.device) -> None:
        super().materialize(device)
        if self.local_rotary_emb is not None:
            self.local_rotary_emb.rebuild()
