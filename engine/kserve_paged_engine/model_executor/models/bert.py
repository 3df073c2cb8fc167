"""BERT-family encoders (all-MiniLM-L6-v2, cross-encoder rerankers): bidirectional attention,
absolute positions, token types, post-norm layers; pooling models only, no LM head.

A prompt is computed whole in one step (the scheduler does not chunk it), so attention is
over the step's own K/V: the step's sequences in a few padded SDPA calls a layer
(`kserve_paged_kernels.dense_attention`), nothing stored in the paged cache. A step with a cached context
(not made by the engine today) takes the paged kernels with `causal=False`. The projections are
`Linear`s packed for the CPU GEMM (`pack_weights`), q/k/v fused into one product.

Token types are not sent with a request: a text pair is `[CLS] a [SEP] b [SEP]`, so a token
after its sequence's first `[SEP]` is of type 1, as BERT's tokenizer numbers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.attention import Attention, AttentionMetadata
from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.models.architectures import architecture_of
from kserve_paged_engine.model_executor.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kserve_paged_engine.model_executor.tp_layout import TPLayout
from kserve_paged_kernels.dense_attention import DenseBatch, dense_attention, dense_batch

# Under tensor parallelism: the row-parallel biases, added once (by rank 0).
_ROW_PARALLEL_BIASES = ("attention.output.dense.bias", "output.dense.bias")
_ACTS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu,
         "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh")}


def _node(**children: nn.Module) -> nn.Module:
    """A container so our parameters carry transformers' names (`attention.self.query`)."""
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


def _row_linear(in_features: int, out_features: int, tp: TPRanks | None) -> Linear:
    """An output projection: under tensor parallelism row-parallel (its partial sums
    all-reduced, the bias added by rank 0 only)."""
    if tp is None:
        return Linear(in_features, out_features)
    return RowParallelLinear(in_features, out_features, True, tp)


class BertLayer(nn.Module):
    """One post-norm layer; under tensor parallelism (`layout`) this rank's heads and
    intermediate columns, the two output projections row-parallel."""

    def __init__(self, config: Any, tp: TPRanks | None = None,
                 layout: TPLayout | None = None) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = h // heads
        self.heads = heads if layout is None else layout.q_heads[1]
        inter = config.intermediate_size if layout is None else layout.intermediate[1]
        local, eps = self.heads * self.head_dim, config.layer_norm_eps
        self.attention = _node(self=_node(query=nn.Linear(h, local), key=nn.Linear(h, local),
                                          value=nn.Linear(h, local)),
                               output=_node(dense=_row_linear(local, h, tp),
                                            LayerNorm=nn.LayerNorm(h, eps)))
        self.intermediate = _node(dense=Linear(h, inter))
        self.output = _node(dense=_row_linear(inter, h, tp), LayerNorm=nn.LayerNorm(h, eps))
        self.attn = Attention(self.heads, self.head_dim, self.heads, self.head_dim ** -0.5,
                              causal=False)
        self.act = _ACTS[config.hidden_act]
        self._qkv: tuple[Linear, ...] = ()  # (fused q/k/v,) once packed: not a checkpoint name

    def pack(self) -> int:
        """q/k/v fused into one `Linear` (one product, one read of x), then every projection
        packed for the CPU matmul kernels; returns how many were packed."""
        sa, h = self.attention.self, self.heads * self.head_dim
        w = sa.query.weight
        qkv = Linear(sa.query.in_features, 3 * h, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]))
            qkv.bias.copy_(torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]))
        qkv.requires_grad_(False)
        self._qkv = (qkv,)
        return sum(int(m.pack()) for m in (qkv, self.attention.output.dense,
                                           self.intermediate.dense, self.output.dense))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self._qkv:
            return self._qkv[0](x)
        sa = self.attention.self
        return torch.cat([sa.query(x), sa.key(x), sa.value(x)], dim=1)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                dense: DenseBatch | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        if dense is not None:
            a = dense_attention(qkv, self.heads, self.head_dim, dense, self.attn.scale)
        else:
            t = x.shape[0]
            q, k, v = (part.reshape(t, self.heads, self.head_dim)
                       for part in qkv.chunk(3, dim=1))
            a = self.attn(q, k, v, kv_cache, meta).reshape(t, -1)
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(a))
        h = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + h)


class BertEncoder(nn.Module):
    """`BertModel` (embeddings) or `BertForSequenceClassification` (its pooler and classifier
    are the classification head, `classify`). Checkpoint names with or without `bert.`.

    Under tensor parallelism (`tp`) the layers hold this rank's heads and intermediate columns
    (engine/kserve_paged_engine/model_executor/tp_layout.py) and the word embeddings a run of the vocabulary; every rank
    ends a layer with the whole hidden state (all-reduced), so pooling and the classifier
    run on rank 0 as at TP = 1."""

    layout: TPLayout | None = None

    def __init__(self, config: Any, tp: TPRanks | None = None) -> None:
        super().__init__()
        self.tp = tp
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
        if tp is not None:
            self.layout = TPLayout.of(self.num_heads, self.num_heads, self.head_dim,
                                      config.intermediate_size, self.vocab_size, tp.rank,
                                      tp.world_size)
            self.num_heads = self.num_kv_heads = self.layout.q_heads[1]
        layout = self.layout
        self.embeddings = _node(
            word_embeddings=nn.Embedding(config.vocab_size, h) if layout is None else
            VocabParallelEmbedding(layout.vocab_per_rank, h, layout.vocab[0], tp),
            position_embeddings=nn.Embedding(config.max_position_embeddings, h),
            token_type_embeddings=nn.Embedding(config.type_vocab_size, h),
            LayerNorm=nn.LayerNorm(h, config.layer_norm_eps))
        self.encoder = _node(layer=nn.ModuleList(BertLayer(config, tp, layout)
                                                 for _ in range(self.num_layers)))
        self.classifies = self.architecture.endswith("ForSequenceClassification")
        if self.classifies:
            self.pooler = _node(dense=nn.Linear(h, h))
            self.classifier = nn.Linear(h, config.num_labels)

    def materialize(self, device: torch.device) -> None:
        self.to_empty(device=device)
        if self.tp is not None:  # the vocabulary shard's padding rows stay zero
            for param in self.parameters():
                param.detach().zero_()

    def pack_weights(self) -> int:
        """Fuse q/k/v and pack the projections for the CPU GEMM (`Linear.pack`); call after
        the weights are final. Returns how many were packed (0 off CPU)."""
        return sum(layer.pack() for layer in self.encoder.layer)

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
        dense = dense_batch(meta.query_start_loc, meta.seq_lens, input_ids.shape[0])
        for layer, kv_cache in zip(self.encoder.layer, kv_caches, strict=True):
            x = layer(x, kv_cache, meta, dense)
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
            target = params[name]
            if self.layout is not None and name == "embeddings.word_embeddings.weight":
                target = target.narrow(0, 0, tensor.shape[0])  # the last shard's padding
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= model shape {tuple(target.shape)}")
            if self.tp is not None and self.tp.rank and name.endswith(_ROW_PARALLEL_BIASES):
                target.zero_()  # the all-reduce adds rank 0's copy once
            else:
                target.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. "
                             f"{sorted(missing)[:5]}")
