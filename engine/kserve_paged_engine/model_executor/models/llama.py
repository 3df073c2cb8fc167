"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) over the paged KV cache.

Written for the engine's step shape: one flat batch of new tokens from many sequences, their
positions, and `AttentionMetadata` saying where each sequence's context lives in the cache. q/k/v
and gate/up are fused into single matmuls; weights are loaded from transformers' names and
fused at load time (`load_weights`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

import kserve_paged_kernels as kernels
from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.attention import Attention, AttentionMetadata
from kserve_paged_engine.model_executor.layers import Linear, RMSNorm, SwiGLUMLP
from kserve_paged_engine.model_executor.models.architectures import architecture_of, decoder_of
from kserve_paged_engine.model_executor.models.hf_checkpoint import TransformersCheckpoint
from kserve_paged_engine.model_executor.models.native_stack import build_native_stack
from kserve_paged_engine.model_executor.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kserve_paged_engine.model_executor.rope import (
    RotaryEmbedding,
    rope_max_positions,
    rope_parameters,
)
from kserve_paged_engine.model_executor.tp_layout import TPLayout
from kserve_paged_kernels import cpu_native

logger = logging.getLogger("kserve_paged_engine")

def sliding_window_of(config: Any) -> int | None:
    """The attention window if any layer uses one (Mistral v0.1, Qwen2 with use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "model_type", None) in ("qwen2", "qwen3", "qwen3_moe") and not getattr(
            config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: global attention). `layer_types` says which layers
    slide (Qwen2 past `max_window_layers`, Gemma's alternation); without it every layer does
    (Mistral v0.1)."""
    window = sliding_window_of(config)
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * layers
    if types is None:
        return [window] * layers
    return [window if t == "sliding_attention" else None for t in types]


def projection_biases(architecture: str, config: Any) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases of a Llama-family architecture, as transformers builds it."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        bias = bool(getattr(config, "attention_bias", False))  # q/k/v and o; none in the MLP
        return bias, bias, False
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias, bool(getattr(config, "mlp_bias", False))


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, paged attention, output projection; with `qk_norm` (Qwen3,
    Gemma 3) an RMSNorm (`norm`) over each head of q and k before RoPE. `window`, `softcap` and
    `scale` (default head_dim ** -0.5) are this layer's attention settings."""

    def __init__(self, config: Any, head_dim: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool = False, *, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.rotary = [rotary]  # shared, kept out of the module tree so it is built once
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads,
                              head_dim ** -0.5 if scale is None else scale, window=window,
                              softcap=softcap)
        self.q_norm = norm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Qwen3's q/k norm in place on the fused rows where the native op runs (the decoder
        # stack's order), then RoPE in place (with the K/V store where one kernel does both);
        # otherwise both on the split heads below.
        normed = self.q_norm is None or self._norm_heads_(qkv)
        stored = normed and self.attn.rope_store_(
            positions, qkv, self.rotary[0].cos, self.rotary[0].sin, kv_cache, meta)
        rotated = stored or (normed and self.rotary[0].rotate_fused_(
            positions, qkv, self.num_heads + self.num_kv_heads))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not normed and self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = self.rotary[0](positions, q, k)
        out = self.attn(q, k, v if stored else v.contiguous(), kv_cache, meta, stored=stored)
        return self.o_proj(out.reshape(t, self.q_size))

    # The `cpu_native` q/k norm in place on fused rows, by name (looked up per call); Gemma's
    # rounds as Gemma does in bf16.
    qk_norm_kernel = "qk_norm_inplace"

    def _norm_heads_(self, qkv: torch.Tensor) -> bool:
        """The q/k norm in place on fused rows (`qk_norm_kernel`, with each norm's
        `native_weight`); False: not done."""
        qn, kn = self.q_norm, self.k_norm
        if qn is None or kn is None or torch.is_grad_enabled() or qn.eps != kn.eps:
            return False
        qw, kw = qn.native_weight(), kn.native_weight()
        return (qw is not None and kw is not None and getattr(cpu_native, self.qk_norm_kernel)(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, qw, kw, qn.eps) is not None)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm."""

    def __init__(self, config: Any, head_dim: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, mlp_bias: bool, qk_norm: bool = False,
                 window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, head_dim, rotary, qkv_bias, o_bias, qk_norm,
                                        window=window)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias)
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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.*` names)."""

    def __init__(self, config: Any, head_dim: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, mlp_bias: bool, qk_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, head_dim, rotary, qkv_bias, o_bias, mlp_bias, qk_norm,
                              window)
            for window in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(TransformersCheckpoint):
    """Paged-cache Llama-family causal LM.

    `forward` maps a flat batch of new tokens to final hidden states; `compute_logits` projects
    only the rows the runner needs (one per sequence) to float32 logits. Weights load from
    transformers' names (`TransformersCheckpoint`, hf_checkpoint.py).
    """

    # Tensor parallelism (set in __init__; subclasses that build themselves stay unsharded).
    tp: TPRanks | None = None
    layout: TPLayout | None = None
    # The decoder stack as one native call, or why the model runs on per-layer modules (both
    # set by pack_weights); `use_native_stack = False` keeps the per-layer modules.
    native_stack: cpu_native.DecoderStack | None = None
    native_stack_declined: str | None = "weights not packed yet"
    use_native_stack = True
    ties_by_default = False  # `tie_word_embeddings` when the config leaves it out

    def __init__(self, config: Any, tp: TPRanks | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu'")
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise ValueError("pretraining_tp > 1 is not supported")
        rope = rope_parameters(config)
        self._read_facts(config, rope)

        decoder = decoder_of(self.architecture)  # a sequence classifier's own decoder
        qk_norm = decoder in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        qkv_bias, o_bias, mlp_bias = projection_biases(decoder, config)

        layer_config = self._tp_config(config, tp)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.max_position_embeddings, rope)
        self.model = LlamaModel(layer_config, self.head_dim, self.rotary_emb, qkv_bias, o_bias,
                                mlp_bias, qk_norm)
        self._heads(config)
        if tp is not None:
            self._shard_modules(tp, o_bias, mlp_bias)
        self.tie_weights()

    def _tp_config(self, config: Any, tp: TPRanks | None) -> Any:
        """Tensor parallelism (Gemma's class too): `tp` and this rank's `layout` set, and the
        config its layers are built from, with this rank's heads and MLP columns (the config
        itself without `tp`)."""
        self.tp = tp
        self.layout: TPLayout | None = None
        if tp is None:
            return config
        self.layout = TPLayout.of(self.num_heads, self.num_kv_heads, self.head_dim,
                                  config.intermediate_size, self.vocab_size, tp.rank,
                                  tp.world_size)
        layer_config = copy.copy(config)
        layer_config.num_attention_heads = self.num_heads = self.layout.q_heads[1]
        layer_config.num_key_value_heads = self.num_kv_heads = self.layout.kv_heads[1]
        layer_config.intermediate_size = self.layout.intermediate[1]
        layer_config.head_dim = self.head_dim
        return layer_config

    def _read_facts(self, config: Any, rope: dict[str, Any]) -> None:
        """The figures of the config every family reads alike, read here once (Gemma's class
        too): sizes, heads, how far the positions reach under `rope` (the global layers'),
        which layers slide, the tie (`ties_by_default` where the config is silent)."""
        self.config = config
        self.architecture = architecture_of(config)
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = (getattr(config, "head_dim", None)
                              or config.hidden_size // config.num_attention_heads)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_position_embeddings: int = rope_max_positions(config.max_position_embeddings,
                                                               rope)
        self.sliding_window: int | None = sliding_window_of(config)
        self.layer_windows: list[int | None] = layer_windows(config)
        self.tie_word_embeddings: bool = bool(getattr(config, "tie_word_embeddings",
                                                      self.ties_by_default))

    def _heads(self, config: Any) -> None:
        """The LM head, or for a sequence classifier (a pooling model) its `score` head over
        the last token's hidden state instead (transformers' names: `score.weight`)."""
        self.classifies = self.architecture != decoder_of(self.architecture)
        if self.classifies:
            self.lm_head = None
            self.tie_word_embeddings = False
            self.score = Linear(config.hidden_size, config.num_labels, bias=False)
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Last-token rows `[N, H]` -> logits `[N, num_labels]` (the `score` head)."""
        if not self.classifies:
            raise ValueError(f"{self.architecture} has no classification head")
        return self.score(pooled)

    def _shard_modules(self, tp: TPRanks, o_bias: bool, mlp_bias: bool) -> None:
        """Swap in the row-parallel projections and the vocabulary shards (the column-parallel
        qkv and gate/up are already this rank's size)."""
        layout = self.layout
        assert layout is not None
        rows = layout.vocab_per_rank
        self.model.embed_tokens = VocabParallelEmbedding(rows, self.hidden_size,
                                                         layout.vocab[0], tp)
        if self.lm_head is not None:
            self.lm_head = Linear(self.hidden_size, rows, bias=False)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, self.hidden_size, o_bias, tp)
            mlp.down_proj = RowParallelLinear(mlp.intermediate_size, self.hidden_size,
                                              mlp_bias, tp)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise if `max_model_len` is past what the model's positions cover (sliding windows
        need no limit: the kernels apply each layer's window)."""
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.max_position_embeddings}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions `[T]` (all sequences' new tokens) -> hidden `[T, hidden_size]`."""
        return self._decode(self.model.embed_tokens(input_ids), positions, kv_caches, meta)

    def _decode(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers and final norm from the embeddings `x`: one native call where the
        stack runs, else the per-layer modules (each layer takes the running residual and
        returns its last block's output; the add is fused into the next norm)."""
        if meta.backend is None:  # the runner sets it; a hand-built step gets it once here
            meta.backend = kernels.resolve_backend(
                x.device, block_size=kv_caches[0].shape[2] if kv_caches else None,
                head_dim=self.head_dim, dtype=x.dtype)
        stacked = self._native_forward(x, positions, kv_caches, meta)
        if stacked is not None:
            return stacked
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def _native_forward(self, x: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], meta: AttentionMetadata
                        ) -> torch.Tensor | None:
        """The whole stack in one native call from the embeddings `x` (the CPU backend's form
        of a whole step), or None where it does not run this step."""
        stack = self.native_stack
        if (stack is not None and self.use_native_stack and meta.backend == "cpu"
                and not torch.is_grad_enabled() and x.device.type == "cpu"
                and x.dtype == stack.dtype and stack.takes_cache(kv_caches[0])):
            rows = meta.rows(x.shape[0])
            group_metas = getattr(meta, "groups", None)  # GroupedMetadata: KV groups
            groups = None
            if group_metas:
                if stack.dtype != torch.float32:
                    return None
                groups = ([layer.self_attn.attn.kv_group for layer in self.model.layers],
                          [(g.slot_mapping, g.block_tables) for g in [meta, *group_metas]])
            if rows is not None:
                return stack.run(x.contiguous(), positions, meta.slot_mapping, kv_caches,
                                 meta.block_tables, *rows, groups=groups)
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden `[N, hidden_size]` -> float32 logits `[N, vocab_size]`; under tensor
        parallelism gathered on rank 0 (the other ranks send their shard and get None)."""
        if self.lm_head is None:
            raise ValueError(f"{self.architecture} is a classifier: it has no LM head to "
                             "sample from")
        if self.tp is None:
            return self.lm_head(hidden).float()
        logits = self.tp.gather_to_first(self.lm_head(hidden))
        return None if logits is None else logits[:, :self.vocab_size].float()

    def pack_weights(self) -> int:
        """Pre-pack every projection for the CPU matmul kernels (see `Linear`); call after the
        weights are final. Returns how many were packed (0 off CPU). When every projection is
        on the native GEMM, the decoder stack also gets its one-call native form."""
        packed = sum(m.pack() for m in self.modules() if isinstance(m, Linear))
        for layer in self.model.layers:
            layer.mlp.pack()
        self.native_stack = self._build_native_stack()
        return packed

    def native_stack_unsupported(self) -> str | None:
        """What of this model the native decoder stack cannot compute, or None. The stack is
        Llama's or Gemma's layer exactly (kernels/kserve_paged_kernels/csrc/decoder_stack.c); each answer names the
        feature, so the log and the tests say why a family runs on per-layer modules."""
        layers = list(self.model.layers)
        if self.tp is not None:
            return "tensor parallelism (one native call leaves no place for the all-reduces)"
        eps = self.model.norm.eps
        if any(n.eps != eps for layer in layers for n in layer.modules()
               if isinstance(n, RMSNorm)):
            return "norms with different epsilons"
        return None

    def _build_native_stack(self) -> cpu_native.DecoderStack | None:
        return build_native_stack(self)

    def tie_weights(self) -> None:
        """Share the LM head with the input embedding when the config says so."""
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device) -> None:
        """Allocate a model built on the meta device: storage on `device`, ties, RoPE table.

        `to_empty()` gives each module its own fresh tensor, which unties shared weights, and
        leaves buffers uninitialised, so both are redone here. Weights come next (`load_weights`).
        """
        self.to_empty(device=device)
        if self.tp is not None:  # the vocabulary shard's padding rows stay zero
            for param in self.parameters():
                param.detach().zero_()
        self.tie_weights()
        self.rotary_emb.rebuild()
