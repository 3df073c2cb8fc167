"""BERT-family encoders (all-MiniLM-L6-v2, cross-encoder rerankers): bidirectional attention,
absolute positions, token types, post-norm layers; pooling models only, no LM head.

Attention goes through the paged kernels with `causal=False`: a prompt is computed whole in
one step (the scheduler does not chunk it), its K/V stored in blocks the request frees when it
ends. Token types are not sent with a request: a text pair is `[CLS] a [SEP] b [SEP]`, so a
token after its sequence's first `[SEP]` is of type 1, as BERT's tokenizer numbers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.attention import Attention, AttentionMetadata
from engine.model_executor.models.architectures import architecture_of

_ACTS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu,
         "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh")}


def _node(**children: nn.Module) -> nn.Module:
    """A container so our parameters carry transformers' names (`attention.self.query`)."""
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.heads, self.head_dim = heads, h // heads
        eps = config.layer_norm_eps
        self.attention = _node(self=_node(query=nn.Linear(h, h), key=nn.Linear(h, h),
                                          value=nn.Linear(h, h)),
                               output=_node(dense=nn.Linear(h, h), LayerNorm=nn.LayerNorm(h, eps)))
        self.intermediate = _node(dense=nn.Linear(h, config.intermediate_size))
        self.output = _node(dense=nn.Linear(config.intermediate_size, h),
                            LayerNorm=nn.LayerNorm(h, eps))
        self.attn = Attention(heads, self.head_dim, heads, self.head_dim ** -0.5, causal=False)
        self.act = _ACTS[config.hidden_act]

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        t, sa = x.shape[0], self.attention.self
        q, k, v = (proj(x).view(t, self.heads, self.head_dim)
                   for proj in (sa.query, sa.key, sa.value))
        a = self.attn(q, k, v, kv_cache, meta).reshape(t, -1)
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(a))
        h = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + h)


class BertEncoder(nn.Module):
    """`BertModel` (embeddings) or `BertForSequenceClassification` (its pooler and classifier
    are the classification head, `classify`). Checkpoint names with or without `bert.`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.architecture = architecture_of(config)
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        if config.hidden_act not in _ACTS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; one of {list(_ACTS)}")
        h = self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.head_dim = h // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.layer_windows: list[int | None] = [None] * self.num_layers
        self.sliding_window = None
        self.type_vocab_size = config.type_vocab_size
        self.sep_token_id: int | None = None  # set by the engine from the tokenizer
        self.embeddings = _node(
            word_embeddings=nn.Embedding(config.vocab_size, h),
            position_embeddings=nn.Embedding(config.max_position_embeddings, h),
            token_type_embeddings=nn.Embedding(config.type_vocab_size, h),
            LayerNorm=nn.LayerNorm(h, config.layer_norm_eps))
        self.encoder = _node(layer=nn.ModuleList(BertLayer(config)
                                                 for _ in range(self.num_layers)))
        self.classifies = self.architecture.endswith("ForSequenceClassification")
        if self.classifies:
            self.pooler = _node(dense=nn.Linear(h, h))
            self.classifier = nn.Linear(h, config.num_labels)

    def materialize(self, device: torch.device) -> None:
        self.to_empty(device=device)

    def pack_weights(self) -> int:
        return 0  # torch's own matmuls: an encoder step is one prefill

    def check_max_model_len(self, max_model_len: int) -> None:
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.max_position_embeddings}")

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """1 after the first [SEP] of each sequence (a pair's second text), else 0."""
        if self.sep_token_id is None or self.type_vocab_size < 2:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).long()
        before = torch.cumsum(sep, 0) - sep  # [SEP]s before each token, over the whole step
        starts = positions == 0
        base = before[starts][torch.cumsum(starts.long(), 0) - 1]
        return (before - base > 0).long()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Whole prompts `[T]` -> final hidden states `[T, hidden_size]`."""
        emb = self.embeddings
        x = (emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
             + emb.token_type_embeddings(self.token_types(input_ids, positions)))
        x = emb.LayerNorm(x)
        for layer, kv_cache in zip(self.encoder.layer, kv_caches, strict=True):
            x = layer(x, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.architecture} is an encoder: it has no LM head to sample from")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """CLS rows `[N, H]` -> logits `[N, num_labels]` (BERT's pooler, then classifier)."""
        if not self.classifies:
            raise ValueError(f"{self.architecture} has no classification head")
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in; ValueError for a shape mismatch or a missing
        one. Tensors this job has no use for (position ids, BertModel's pooler) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name not in params:
                if name.startswith(("pooler.", "embeddings.position_ids")):
                    continue
                raise ValueError(f"checkpoint tensor {hf_name} has no place in "
                                 f"{self.architecture}")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= model shape {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. "
                             f"{sorted(missing)[:5]}")
