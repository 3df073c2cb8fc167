"""`--quantization gguf`: a GGUF's quantized projections kept quantized at load.

The file is read once (engine/kserve_paged_engine/model_executor/quantization/gguf_read.py: the projections' blocks as groups, the
rest as float tensors); this module gives each projection its layout:
- Q4_0, Q4_1, Q4_K: int4 in groups of 32, the blocks' own codes, scales and minimums (exact);
- Q8_0 and Q6_K: int8 with their own scales, per group of 32 and of 16 (exact), on our float32
  kernel; for PyTorch's kernel (other dtypes, no native library), which takes one scale per
  channel, Q8_0 is re-quantized from the dequantized weight and Q6_K stays float;
- every other quantized type (Q5_0, Q5_1, Q5_K, Q2_K, Q3_K, IQ*): the nearest layout our
  float32 kernel holds, int8 in groups of 32 re-quantized from the dequantized weight (each
  weight within half its group's step, max |w| / 254: finer than the 2-6-bit original), when
  every part of the projection is such a type;
- float types (F32, F16, BF16): kept in the model's dtype.
The log names each projection's layout and whether it is exact.
A fused projection (q/k/v, gate/up) is quantized only when all its parts share one layout.
llama.cpp stores Llama's q/k rows permuted; gguf_read.py puts the groups back in transformers'
row order with transformers' own tensor processor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.quantization import gguf_blocks
from kserve_paged_engine.model_executor.quantization.gguf_read import GGUFTensor
from kserve_paged_engine.model_executor.quantization.layouts import (
    Picker,
    QuantSummary,
    VocabPicker,
    apply,
    hf_parts,
    requantized_rows,
)
from kserve_paged_kernels import quant_linear


def picker(tensors: dict[str, GGUFTensor], dtype: torch.dtype) -> Picker:
    """The layout of each projection from its GGUF tensors (see the module docstring)."""
    def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
        parts = [tensors.get(p) for p in hf_parts(name)]
        kept = str(linear.weight.dtype).removeprefix("torch.")
        if any(p is None for p in parts):
            return f"{kept} (not in the GGUF's tensors)", None
        qtypes = sorted({p.qtype for p in parts if p is not None})
        groups = [p.int4 for p in parts if p is not None and p.int4 is not None]
        if len(groups) == len(parts):
            codes, scale, minimum = (torch.cat(cols) for cols in zip(*groups, strict=True))
            # PyTorch's kernel holds the scales in the activation dtype (bf16 rounds fp16's).
            exact = ("exact" if quant_linear.native_for(dtype) or dtype == torch.float32
                     else f"scales rounded to {str(dtype).removeprefix('torch.')}")
            return (f"int4 g32 ({'+'.join(qtypes)}, {exact})",
                    quant_linear.pack_int4(codes, scale, minimum, gguf_blocks.GROUP, dtype))
        int8 = [p.int8 for p in parts if p is not None and p.int8 is not None]
        native = quant_linear.native_for(dtype)
        if len(int8) == len(parts) and native:
            codes, scale = _stacked(int8)
            group = codes.shape[1] // scale.shape[1]
            return (f"int8 g{group} ({'+'.join(qtypes)}, exact)",
                    quant_linear.pack_int8(codes, scale, group, dtype))
        if qtypes == ["Q8_0"]:
            return "int8 per-channel (Q8_0 re-quantized)", quant_linear.quantize_int8(
                linear.weight, dtype)
        int4 = {t.name for t in gguf_blocks.INT4_TYPES}
        if (native and not set(qtypes) & {*FLOAT_TYPES, *int4}
                and linear.weight.shape[1] % gguf_blocks.GROUP == 0):
            codes, scale = _stacked(_int8_parts([p for p in parts if p is not None],
                                                linear.weight))
            group = codes.shape[1] // scale.shape[1]
            return (f"int8 g{group} ({'+'.join(qtypes)}: "
                    f"{'+'.join(t for t in qtypes if t not in ('Q8_0', 'Q6_K'))} re-quantized, "
                    "within half a step)", quant_linear.pack_int8(codes, scale, group, dtype))
        return f"{kept} (from {'+'.join(qtypes)})", None
    return pick


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _stacked(int8: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts' (codes, scale) stacked along the output, their scales repeated to the smallest
    group (a Q8_0 scale of 32 is two equal scales of 16 next to Q6_K's): still exact."""
    groups = [c.shape[1] // s.shape[1] for c, s in int8]
    small = min(groups)
    scales = [s.repeat_interleave(g // small, dim=1) for (_, s), g in zip(int8, groups,
                                                                         strict=True)]
    return torch.cat([c for c, _ in int8]), torch.cat(scales)


def requantized_groups(weight: torch.Tensor, group: int = gguf_blocks.GROUP
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 (codes, scale) per group of `group` inputs of a float weight: each weight
    within half its group's step (max |w| / 254)."""
    w = weight.detach().float()
    g = w.reshape(w.shape[0], -1, group)
    scale = g.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return codes, scale


def _int8_parts(parts: list[GGUFTensor], weight: torch.Tensor
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each part of a fused projection as int8 (codes, scale): Q8_0 and Q6_K as stored, the
    others re-quantized from their rows of the dequantized weight."""
    out, row = [], 0
    for part in parts:
        out.append(part.int8 if part.int8 is not None
                   else requantized_groups(weight[row:row + part.rows]))
        row += part.rows
    return out


def vocab_picker(tensors: dict[str, GGUFTensor], dtype: torch.dtype, source: str
                 ) -> VocabPicker:
    """A Q8_0 or Q6_K embedding or LM head exactly (its groups of 32 or 16) on our float32
    kernel; any other quantized one (or for PyTorch's kernel) re-quantized per row."""
    fallback = requantized_rows(source, dtype)

    def pick(name: str, weight: torch.Tensor) -> tuple[str, quant_linear.Int8Weight]:
        entry = tensors.get(name)
        if entry is not None and entry.int8 is not None and quant_linear.native_for(dtype):
            codes, scale = entry.int8
            group = codes.shape[1] // scale.shape[1]
            return (f"int8 g{group} ({entry.qtype}, exact)",
                    quant_linear.pack_int8(codes, scale, group, dtype))
        return fallback(name, weight)
    return pick


def keeper(tensors: dict[str, GGUFTensor], dtype: torch.dtype, label: str
           ) -> Callable[[nn.Module], QuantSummary]:
    """What the loader runs on the loaded model: the projections by `picker`, and the
    embedding (with the LM head) as int8 when the file stored it quantized. `tensors` is read
    when it runs (the one-read stream fills it while the weights load)."""
    def keep(model: nn.Module) -> QuantSummary:
        embedding = tensors.get("model.embed_tokens")
        # Under tensor parallelism the vocabulary is sharded by rows (VocabParallelEmbedding)
        # and stays float, dequantized; the projections keep their blocks, cut per rank.
        sharded = getattr(model, "layout", None) is not None
        vocab = None if (embedding is None or embedding.qtype in FLOAT_TYPES
                         or sharded) else vocab_picker(tensors, dtype, embedding.qtype)
        return apply(model, picker(tensors, dtype), f"gguf ({label})", vocab)
    return keep
