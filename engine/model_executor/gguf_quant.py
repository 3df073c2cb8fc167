"""`--quantization gguf`: a GGUF's quantized projections kept quantized at load.

transformers still reads the file (config, norms, embedding, and every tensor dequantized, which
is what the float path serves); this module reads the same file's raw blocks with the `gguf`
package and gives each projection its layout:
- Q4_0, Q4_1, Q4_K: int4 in groups of 32, the blocks' own codes, scales and minimums (exact);
- Q8_0: int8 with one scale per output channel, re-quantized from the dequantized weight (a
  group-wise int8 kernel would keep it exact; PyTorch's takes one scale per channel);
- anything else (F32, F16, Q5_K, Q6_K, ...): kept in the model's dtype, named in the log.
A fused projection (q/k/v, gate/up) is quantized only when all its parts share one layout.
llama.cpp stores Llama's q/k rows permuted; the row order is found by comparing the blocks'
dequantized rows with transformers' tensor, so a layout we misread is an error at load, never
a wrong weight served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.model_executor import gguf_blocks
from engine.model_executor.layers import Linear
from engine.model_executor.quantization import Picker, QuantSummary, apply, hf_parts
from kernels import quant_linear

TensorMap = dict[str, torch.Tensor]


@dataclass(slots=True)
class GGUFTensor:
    """One GGUF projection: its block type, and for a 4-bit type its groups in HF row order."""

    qtype: str
    int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _arch(reader: Any) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _row_orders(rows: int, config: Any) -> list[np.ndarray]:
    """Candidate row orders: as stored, or undoing llama.cpp's q/k permutation for q's heads
    or the KV heads (`hf[i] = stored[order[i]]`)."""
    orders = [np.arange(rows)]
    for heads in (config.num_attention_heads, config.num_key_value_heads):
        if heads and rows % (2 * heads) == 0:
            idx = np.arange(rows).reshape(heads, rows // heads // 2, 2)
            orders.append(idx.swapaxes(1, 2).reshape(rows))
    return orders


def _in_hf_order(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
                 reference: torch.Tensor, config: Any) -> GGUFTensor | None:
    """The groups reordered to match transformers' dequantized tensor, or None if no order
    does (a layout not read right)."""
    deq = codes.astype(np.float32).reshape(*scale.shape, -1) * scale[..., None] + minimum[..., None]
    deq = deq.reshape(codes.shape)
    ref = reference.detach().float().numpy()
    tol = 1e-6 * max(float(np.abs(ref).max()), 1e-30)
    for order in _row_orders(codes.shape[0], config):
        if np.allclose(deq[order], ref, rtol=1e-6, atol=tol):
            return GGUFTensor("", tuple(torch.from_numpy(np.ascontiguousarray(a[order]))
                                        for a in (codes, scale, minimum)))
    return None


def read(path: Path, state: TensorMap, config: Any) -> dict[str, GGUFTensor]:
    """transformers' projection name (no `.weight`) -> its GGUF block type and 4-bit groups,
    for every tensor of `state` (transformers' dequantized weights) the file names."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_name = _arch(reader)
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to the gguf package")
    names = gguf.get_tensor_name_map(archs[arch_name], config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, GGUFTensor] = {}
    for hf_name, reference in state.items():
        if not hf_name.endswith(".weight") or reference.dim() != 2:
            continue
        key = hf_name.removesuffix(".weight")
        gguf_name = names.get_name(key)
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None:
            continue
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        entry = GGUFTensor(qtype.name)
        if qtype in gguf_blocks.INT4_TYPES:
            rows, cols = reference.shape
            groups = gguf_blocks.int4_groups(np.asarray(tensor.data), qtype, rows, cols)
            ordered = _in_hf_order(*groups, reference, config)
            if ordered is None:
                raise ValueError(f"GGUF tensor {gguf_name} ({qtype.name}) does not match its "
                                 f"dequantized form in any known row order")
            entry.int4 = ordered.int4
        out[key] = entry
    return out


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
            return (f"int4 g32 ({'+'.join(qtypes)}, exact)",
                    quant_linear.pack_int4(codes, scale, minimum, gguf_blocks.GROUP, dtype))
        if qtypes == ["Q8_0"]:
            return "int8 per-channel (Q8_0 re-quantized)", quant_linear.quantize_int8(
                linear.weight, dtype)
        return f"{kept} (from {'+'.join(qtypes)})", None
    return pick


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def keeper(tensors: dict[str, GGUFTensor], dtype: torch.dtype, label: str
           ) -> Callable[[nn.Module], QuantSummary]:
    """What the loader runs on the loaded model: the projections by `picker`, and the
    embedding (with the LM head) as int8 rows when the file stored it quantized."""
    embedding = tensors.get("model.embed_tokens")
    vocab = None if embedding is None or embedding.qtype in FLOAT_TYPES else embedding.qtype
    return lambda model: apply(model, picker(tensors, dtype), f"gguf ({label})", vocab)
