"""AWQ and GPTQ checkpoints (safetensors with a `quantization_config` in config.json): their
4-bit projections served with the checkpoint's own codes, scales and zeros.

The formats (kernels/kserve_paged_kernels/int4_layouts.py) store `w = (q - z) s` per group of input features:
- on CPU that is our `Int4Weight` with `minimum = -z s`, exact, when each group is a run of
  consecutive inputs; a GPTQ checkpoint quantized in activation order (`desc_act`) is not, and
  the packed CPU kernel cannot read it, so such a projection is served dequantized and the
  start-up log names it;
- on CUDA the words are kept as stored (`CheckpointInt4Weight`) for the Triton GEMM, which reads
  `g_idx` per input row, activation order included.

The loader reads the parts as they stream by and hands the model each projection's dequantized
float weight (so loading is the float path's); `picker` then swaps in the packed codes, which
stand for that very weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.quantization.layouts import Picker, hf_parts
from kserve_paged_engine.model_executor.quantization.tp_cuts import (
    CutOf,
    cut_float,
    cut_int4,
    one_cut,
)
from kserve_paged_kernels import quant_linear
from kserve_paged_kernels.int4_layouts import (
    CheckpointInt4Weight,
    codes_and_zeros,
    dequant_checkpoint,
)

CHECKPOINT_METHODS = ("awq", "gptq")
PARTS = ("qweight", "qzeros", "scales", "g_idx")
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [out, in], scale, minimum


@dataclass(slots=True, frozen=True)
class Int4Checkpoint:
    """What config.json's `quantization_config` says about the checkpoint's 4-bit layout."""

    method: str
    group_size: int
    zero_offset: int  # added to every stored zero: 1 for GPTQ's original format


def read_config(raw_config: dict[str, Any]) -> Int4Checkpoint | None:
    """The checkpoint's AWQ/GPTQ layout, None for any other checkpoint; ValueError for a layout
    this engine cannot serve, before any weight is read."""
    qc = raw_config.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method not in CHECKPOINT_METHODS:
        return None
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


def checkpoint_weight(parts: dict[str, torch.Tensor], ckpt: Int4Checkpoint
                      ) -> CheckpointInt4Weight:
    """One projection's tensors as the kernels' `CheckpointInt4Weight`."""
    scales = parts["scales"]
    in_f = parts["qweight"].shape[0] * (1 if ckpt.method == "awq" else 8)
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_f) // ckpt.group_size
    return CheckpointInt4Weight(parts["qweight"].to(torch.int32), parts["qzeros"].to(torch.int32),
                                scales, g_idx.to(torch.int32), ckpt.method == "awq",
                                ckpt.zero_offset, scales.shape[1], in_f)


def cpu_groups(weight: CheckpointInt4Weight) -> Groups | None:
    """(codes, scale, minimum) per group for `Int4Weight`, or None when the groups are not runs
    of consecutive inputs of a size the packed kernel takes (activation order, one group per
    channel)."""
    group_size = weight.in_features // weight.scales.shape[0]
    if group_size == 0:  # a rank's cut of an activation-order weight keeps every group
        return None
    consecutive = torch.arange(weight.in_features) // group_size
    if group_size not in quant_linear.INT4_GROUP_SIZES or not torch.equal(
            weight.g_idx.long(), consecutive):
        return None
    codes, zeros = codes_and_zeros(weight)
    scales = weight.scales.float()
    return (codes.to(torch.uint8).t().contiguous(), scales.t().contiguous(),
            (-zeros * scales).t().contiguous())


def fused(parts: list[CheckpointInt4Weight]) -> CheckpointInt4Weight | None:
    """Projections stacked along the output (q/k/v, gate/up) as one weight; None when their
    inputs are grouped differently (activation order per projection)."""
    first = parts[0]
    if any(not torch.equal(p.g_idx, first.g_idx) for p in parts[1:]):
        return None
    out = sum(p.out_features for p in parts)
    return CheckpointInt4Weight(
        torch.cat([p.qweight for p in parts], 1), torch.cat([p.qzeros for p in parts], 1),
        torch.cat([p.scales for p in parts], 1), first.g_idx, first.awq, first.zero_offset,
        out, first.in_features)


@dataclass(slots=True)
class Int4Reader:
    """Turns a checkpoint's stream of tensors into the float stream the model loads: each
    projection's packed parts are held until the stream ends, then given as one dequantized
    `.weight`; `weights` keeps them for `picker`."""

    ckpt: Int4Checkpoint
    weights: dict[str, CheckpointInt4Weight] = field(default_factory=dict)
    # Tensor parallelism: the rank's cut of each checkpoint tensor (`TPLayout.weight_slice`),
    # applied to the whole tensors streamed in, the packed ones in their packed form.
    cut: CutOf | None = None

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf in PARTS:
                parts = pending.setdefault(prefix, {})
                parts[leaf] = tensor
                if self._complete(parts):  # done with its whole tensors (a rank keeps a cut)
                    yield self._finish(prefix, pending.pop(prefix))
            else:
                yield name, cut_float(name, tensor, self.cut)
        for prefix, parts in pending.items():
            yield self._finish(prefix, parts)

    def _complete(self, parts: dict[str, torch.Tensor]) -> bool:
        """Every part a projection can have is in (GPTQ's g_idx may be absent: then at the
        stream's end)."""
        return {"qweight", "qzeros", "scales"} <= parts.keys() and (
            self.ckpt.method == "awq" or "g_idx" in parts)

    def _finish(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        missing = {"qweight", "qzeros", "scales"} - parts.keys()
        if missing:
            raise ValueError(f"{self.ckpt.method} checkpoint: {prefix} lacks "
                             f"{', '.join(sorted(missing))}")
        self.weights[prefix] = self.cut_stored(prefix, checkpoint_weight(parts, self.ckpt))
        return f"{prefix}.weight", dequant_checkpoint(self.weights[prefix])

    def cut_stored(self, prefix: str, weight: CheckpointInt4Weight) -> CheckpointInt4Weight:
        """This rank's share of a projection's words (all of them without tensor parallelism)."""
        cut = one_cut(prefix, self.cut(f"{prefix}.weight")) if self.cut is not None else None
        return weight if cut is None else cut_int4(prefix, weight, cut)

    def picker(self, dtype: torch.dtype, triton: bool | None = None) -> Picker:
        """Our projection -> the checkpoint's codes (stacked for a fused one): `Int4Weight` on
        CPU, the words as stored for the Triton GEMM on CUDA (`triton`: that choice forced);
        None (dequantized) where the layout cannot hold it."""
        dequantized = (f"{str(dtype).removeprefix('torch.')} (dequantized: groups the packed "
                       "kernel cannot read)")

        def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
            parts = [self.weights.get(p) for p in hf_parts(name)]
            if any(p is None for p in parts):
                return f"{str(dtype).removeprefix('torch.')} (not quantized)", None
            size = parts[0].in_features // parts[0].scales.shape[0]
            label = f"{self.ckpt.method} int4 g{size}"
            if linear.weight.device.type == "cuda" if triton is None else triton:
                one = fused(parts)
                if one is None:
                    return dequantized, None
                return f"{label} (Triton)", CheckpointInt4Weight(
                    *(t.to(linear.weight.device) for t in (one.qweight, one.qzeros, one.scales,
                                                           one.g_idx)),
                    one.awq, one.zero_offset, one.out_features, one.in_features)
            groups = [cpu_groups(p) for p in parts]
            if any(g is None for g in groups):
                return dequantized, None
            codes, scale, minimum = (torch.cat(t) for t in zip(*groups, strict=True))
            return label, quant_linear.pack_int4(codes, scale, minimum, size, dtype)
        return pick
