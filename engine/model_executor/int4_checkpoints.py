"""AWQ and GPTQ checkpoints (safetensors with a `quantization_config` in config.json): their
4-bit projections served as `Int4Weight` with the checkpoint's own codes, scales and zeros.

Both store, per projection, int32 words of eight 4-bit codes, fp16 scales and packed zeros per
group of input features, `w = (q - z) * s`, which is our `w = q * scale + minimum` with
`minimum = -z * s`:
- AWQ (`version: gemm`): `qweight` `[in, out / 8]` packed along the output dimension, nibble i
  of a word holding output column `8 c + AWQ_ORDER[i]`; `qzeros` `[in / group, out / 8]` the
  same way; `scales` `[in / group, out]`.
- GPTQ: `qweight` `[in / 8, out]` packed along the input dimension in order; `qzeros`
  `[groups, out / 8]` in order, stored as `z - 1` by the original format (`checkpoint_format`
  `gptq`), as `z` by `gptq_v2`; `scales` `[groups, out]`; `g_idx` `[in]`, each input feature's
  group. A checkpoint quantized in activation order (`desc_act`) has groups that are not runs
  of consecutive inputs, which the packed kernel cannot read: such a projection is served
  dequantized, and the start-up log names it.

The loader reads the parts as they stream by and hands the model each projection's dequantized
float weight (so loading is the float path's); `picker` then swaps in the packed codes, which
stand for that very weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model_executor.layers import Linear
from engine.model_executor.quantization import Picker, hf_parts
from kernels import quant_linear

CHECKPOINT_METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i of a word
PARTS = ("qweight", "qzeros", "scales", "g_idx")
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [out, in], scale, minimum


@dataclass(slots=True, frozen=True)
class Int4Checkpoint:
    """What config.json's `quantization_config` says about the checkpoint's 4-bit layout."""

    method: str
    group_size: int
    zero_offset: int  # added to every stored zero: 1 for GPTQ's original format


def read_config(raw_config: dict[str, Any]) -> Int4Checkpoint | None:
    """The checkpoint's AWQ/GPTQ layout, None for a float checkpoint; ValueError for a layout
    this engine cannot serve, before any weight is read."""
    qc = raw_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"config.json's quantization_config has quant_method {method!r}; "
                         f"this engine serves {', '.join(CHECKPOINT_METHODS)} checkpoints")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights: only 4-bit is served")
    if group not in quant_linear.INT4_GROUP_SIZES:
        raise ValueError(f"{method} checkpoint with group_size {group}: the packed kernel takes "
                         f"groups of {', '.join(map(str, quant_linear.INT4_GROUP_SIZES))}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {qc.get('version')!r}: only the 'gemm' layout is served")
    if method == "awq" and qc.get("zero_point") is False:
        raise ValueError("AWQ without zero points is not served")
    v1 = method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() == "gptq"
    return Int4Checkpoint(method, int(group), 1 if v1 else 0)


def unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit codes (uint8), nibble i at index 8 w + i along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = words.to(torch.int32).unsqueeze(-1)
    codes = ((w >> shifts) & 0xF).to(torch.uint8)  # [..., 8] at the end
    codes = codes.movedim(-1, dim + 1) if dim == 0 else codes
    shape = list(words.shape)
    shape[dim] *= 8
    return codes.reshape(shape)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words `[rows, out / 8]` -> codes `[rows, out]` in output-column order."""
    codes = unpack(words, 1).reshape(words.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(j) for j in range(8)]
    return codes[..., inverse].reshape(words.shape[0], -1)


def groups_of(parts: dict[str, torch.Tensor], ckpt: Int4Checkpoint
              ) -> tuple[Groups | None, torch.Tensor]:
    """(codes, scale, minimum) per group when the groups are consecutive inputs (else None),
    and the dequantized float32 weight `[out, in]`."""
    scales = parts["scales"].float()  # [groups, out]
    if ckpt.method == "awq":
        codes = _awq_columns(parts["qweight"])  # [in, out]
        zeros = _awq_columns(parts["qzeros"])  # [groups, out]
    else:
        codes = unpack(parts["qweight"], 0)  # [in, out]
        zeros = unpack(parts["qzeros"], 1)[:, :scales.shape[1]]
    zeros = zeros.float() + ckpt.zero_offset
    in_f = codes.shape[0]
    consecutive = torch.arange(in_f) // ckpt.group_size
    g_idx = parts.get("g_idx")
    g_idx = consecutive if g_idx is None else g_idx.long()
    weight = ((codes.float() - zeros[g_idx]) * scales[g_idx]).t().contiguous()
    if not torch.equal(g_idx, consecutive):
        return None, weight
    minimum = -zeros * scales
    return (codes.t().contiguous(), scales.t().contiguous(), minimum.t().contiguous()), weight


@dataclass(slots=True)
class Int4Reader:
    """Turns a checkpoint's stream of tensors into the float stream the model loads: each
    projection's packed parts are held until the stream ends, then given as one dequantized
    `.weight`; `groups` keeps the codes of those that can stay packed."""

    ckpt: Int4Checkpoint
    groups: dict[str, Groups] = field(default_factory=dict)
    dequantized: list[str] = field(default_factory=list)  # act-order projections

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf in PARTS:
                pending.setdefault(prefix, {})[leaf] = tensor
            else:
                yield name, tensor
        for prefix, parts in pending.items():
            missing = {"qweight", "qzeros", "scales"} - parts.keys()
            if missing:
                raise ValueError(f"{self.ckpt.method} checkpoint: {prefix} lacks "
                                 f"{', '.join(sorted(missing))}")
            groups, weight = groups_of(parts, self.ckpt)
            if groups is None:
                self.dequantized.append(prefix)
            else:
                self.groups[prefix] = groups
            yield f"{prefix}.weight", weight

    def picker(self, dtype: torch.dtype) -> Picker:
        """Our projection -> the checkpoint's codes, stacked for a fused one (q/k/v, gate/up)
        when every part kept its codes."""
        label = f"{self.ckpt.method} int4 g{self.ckpt.group_size}"

        def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
            parts = [self.groups.get(p) for p in hf_parts(name)]
            if any(p is None for p in parts):
                kept = str(linear.weight.dtype).removeprefix("torch.")
                return f"{kept} (dequantized: activation-order groups or not quantized)", None
            codes, scale, minimum = (torch.cat(t) for t in zip(*parts, strict=True))
            return label, quant_linear.pack_int4(codes, scale, minimum, self.ckpt.group_size,
                                                 dtype)
        return pick
