"""Which layout each projection of a loaded model gets under `--quantization` (the engine picks;
kernels/kserve_paged_kernels/quant_linear.py packs and multiplies).

Methods (their names: engine/kserve_paged_engine/config/quantization.py): `gguf` (a GGUF's 4-bit tensors
kept as they are, engine/kserve_paged_engine/model_executor/quantization/gguf_quant.py), vLLM's `fp8` (fp8_checkpoints.py), and
two of ours for a float checkpoint, quantized at load: `int4` (asymmetric 4-bit, groups of 32)
and `int8` (symmetric, one scale per output channel). The decoder layers' projections are quantized; the embedding and the LM head
stay in the model's dtype, except a GGUF's quantized embedding, served as int8 rows. CPU only;
under tensor parallelism each rank's weights are cut first (tp_cuts.py, tp_online.py). With float32 activations the weights run on our native kernel
(kernels/kserve_paged_kernels/cpu_native/quant_gemm.py), otherwise on PyTorch's packed CPU kernels; the log names
the kernel of each format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_kernels import quant_linear

logger = logging.getLogger("kserve_paged_engine")

INT4_GROUP = 32  # `--quantization int4`'s group size (GGUF's blocks are 32 weights too)

# Our fused projections and the transformers projections whose rows they stack, in order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# How the start-up log names each kind of projection.
KIND_NAMES = {"qkv_proj": "q/k/v", "o_proj": "o", "gate_up_proj": "gate/up", "down_proj": "down"}


@dataclass(slots=True)
class QuantSummary:
    """What format each projection runs in: format -> module names (for the start-up log)."""

    formats: dict[str, list[str]] = field(default_factory=dict)
    weight_bytes: int = 0
    vocab: str = "embedding and LM head stay float"
    activations: str = ""

    def add(self, fmt: str, name: str) -> None:
        self.formats.setdefault(fmt, []).append(name)

    def describe(self) -> str:
        """Per kind of projection its format, e.g. `q/k/v, o, gate/up, down: int4 g32 (Q4_1,
        exact) [native kernel]`; a kind split between formats says in how many layers each."""
        totals: dict[str, int] = {}
        for names in self.formats.values():
            for name in names:
                kind = name.rsplit(".", 1)[-1]
                totals[kind] = totals.get(kind, 0) + 1
        parts = []
        for fmt, names in self.formats.items():
            kinds: dict[str, int] = {}
            for name in names:
                kind = name.rsplit(".", 1)[-1]
                kinds[kind] = kinds.get(kind, 0) + 1
            labels = [KIND_NAMES.get(k, k) + ("" if n == totals[k] else f" ({n} of {totals[k]})")
                      for k, n in kinds.items()]
            parts.append(f"{', '.join(labels)}: {fmt}")
        acts = f"; {self.activations} activations" if self.activations else ""
        return (f"{'; '.join(parts)} ({self.weight_bytes / 2**20:.1f} MiB); {self.vocab}"
                f"{acts}")


def projections(model: nn.Module) -> list[tuple[str, Linear]]:
    """The decoder layers' projections (`model.layers.*`), by module name."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and name.startswith("model.layers.")]


def hf_parts(name: str) -> list[str]:
    """transformers' names of the projections one of ours stacks (qkv -> q, k, v)."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{p}" for p in FUSED_PARTS.get(leaf, (leaf,))]


# (module name, projection) -> (format named in the log, weight; None: kept as it is).
Picker = Callable[[str, Linear], "tuple[str, quant_linear.QuantWeight | None]"]


def on_the_fly(method: str, dtype: torch.dtype, whole: Any = None) -> Picker:
    """`--quantization int4|int8`: each projection's float weight quantized as it is (`fp8`'s
    picker is engine/kserve_paged_engine/model_executor/quantization/fp8_checkpoints.py's, which builds on this module).
    `whole` (tensor parallelism, tp_online.WholeRows): int8's row scales over whole rows."""
    def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
        w = linear.weight
        if method == "int8":
            rows = None if whole is None else whole.rows(name)
            return "int8 per-channel", quant_linear.quantize_int8(w, dtype, rows)
        if w.shape[1] % INT4_GROUP:
            return f"{str(w.dtype).removeprefix('torch.')} (in_features not whole groups)", None
        codes, scale, minimum = quant_linear.quantize_int4(w, INT4_GROUP)
        return (f"int4 g{INT4_GROUP}",
                quant_linear.pack_int4(codes, scale, minimum, INT4_GROUP, dtype))
    return pick


# (module name, float weight) -> (format named in the log, the int8 weight) for the vocabulary.
VocabPicker = Callable[[str, torch.Tensor], "tuple[str, quant_linear.Int8Weight]"]


def requantized_rows(source: str, dtype: torch.dtype) -> VocabPicker:
    """Each row re-quantized to int8 with one scale (each weight moves by at most half its
    row's step, max |row| / 254)."""
    def pick(name: str, weight: torch.Tensor) -> tuple[str, quant_linear.Int8Weight]:
        return f"int8 per row ({source} re-quantized)", quant_linear.quantize_int8(weight, dtype)
    return pick


class Int8Embedding(nn.Module):
    """An embedding looked up from int8 rows with one scale each, in the model's dtype; the
    tied LM head multiplies by the same codes (`Linear.quantize` with the same `Int8Weight`)."""

    def __init__(self, weight: quant_linear.Int8Weight, dtype: torch.dtype = torch.float32
                 ) -> None:
        super().__init__()
        self.weight_q, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant_linear.int8_rows(ids, self.weight_q).to(self.dtype)


def quantize_vocab(model: nn.Module, pick: VocabPicker) -> str:
    """The embedding (and the LM head, tied or not) as int8 by `pick`; returns the log's
    words."""
    inner: Any = model.model
    fmt, embedding = pick("model.embed_tokens", inner.embed_tokens.weight)
    head: Any = model.lm_head
    tied = head.weight is inner.embed_tokens.weight
    head.quantize(embedding if tied else pick("lm_head", head.weight)[1])
    inner.embed_tokens = Int8Embedding(embedding, inner.embed_tokens.weight.dtype)
    return (f"embedding{' and tied LM head' if tied else ' and LM head'}: {fmt}, "
            f"{embedding.kernel} kernel")


def apply(model: nn.Module, pick: Picker, label: str, vocab: VocabPicker | None = None
          ) -> QuantSummary:
    """Quantize each decoder projection `pick` gives a layout for, and with `vocab` the
    embedding and LM head as int8 rows; log what runs in which format on which kernel. Call
    after the weights are loaded, before `pack_weights`."""
    summary = QuantSummary()
    if vocab is not None:
        summary.vocab = quantize_vocab(model, vocab)
    for name, linear in projections(model):
        fmt, weight = pick(name, linear)
        if weight is None:
            summary.add(fmt, name)
            summary.weight_bytes += linear.weight.nbytes
            continue
        summary.add(f"{fmt} [{weight.kernel} kernel]", name)
        linear.quantize(weight)
        summary.weight_bytes += weight.nbytes()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.numel()),
                 None)
    summary.activations = str(dtype).removeprefix("torch.") if dtype is not None else ""
    logger.info("quantization %s: decoder projections %s", label, summary.describe())
    return summary
