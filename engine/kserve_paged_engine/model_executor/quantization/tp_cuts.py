"""Quantized weights cut for one tensor-parallel rank in their stored form.

The loader's cut of a checkpoint tensor (`TPLayout.weight_slice`: output rows of a
column-parallel projection, input columns of a row-parallel one) is applied here to the
packed tensors, so each rank keeps only its share of the codes and of the scales and zeros
that go with them:

- output rows: a row's scales and zeros are its own; 4-bit zeros (and AWQ's codes) are packed
  eight output columns to an int32 word, so the cut must fall on a multiple of 8;
- input columns: a group's scale covers a run of inputs, so the cut must fall on group
  boundaries (GPTQ's codes also pack eight inputs a word; fp8 blocks cover `bk` inputs;
  GGUF's blocks are decoded to groups of 32, 16 for Q6_K, at read, so those are the units,
  not the 256-wide super-blocks, whose sub-block scales are exact per group once decoded).

A cut that does not fall on those boundaries is refused with a ValueError naming the
projection, its shape, the rank's range and the unit, at load, before the model is served.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from kserve_paged_kernels.int4_layouts import CheckpointInt4Weight

Cut = tuple[int, int, int]  # (dim, start, size): dim 0 output rows, 1 input columns
CutOf = Callable[[str], "Cut | list[Cut] | None"]  # TPLayout.weight_slice

SCALE_PARTS = ("weight_scale", "weight_zero_point", "weight_scale_inv")


def one_cut(name: str, cut: Cut | list[Cut] | None) -> Cut | None:
    """The cut as one range; a checkpoint tensor stored fused (several ranges) is not cut in
    a quantized form."""
    if isinstance(cut, list):
        raise ValueError(f"tensor parallelism: {name} is stored fused and quantized; only "
                         "separate quantized projections are cut per rank")
    return cut


def check(name: str, shape: tuple[int, int], cut: Cut, unit: int, what: str) -> None:
    """ValueError unless the cut starts and ends on a multiple of `unit` (or at the end)."""
    dim, start, size = cut
    end = start + size
    if start % unit == 0 and (end % unit == 0 or end == shape[dim]):
        return
    side = "output rows" if dim == 0 else "input columns"
    raise ValueError(
        f"tensor parallelism cannot cut {name} {list(shape)}: this rank's {side} "
        f"{start}:{end} do not fall on the {unit}-wide {what}; serve it with a "
        "tensor_parallel_size whose shards are whole units, or with tensor_parallel_size 1")


def narrow_units(t: torch.Tensor, dim: int, start: int, size: int, unit: int) -> torch.Tensor:
    """The rows (`dim` 0) or columns of `t` holding one entry per `unit` weights, for the
    weights `start:start + size` (a cut `check`ed on `unit`)."""
    first = start // unit
    return t.narrow(dim, first, -(-(start + size) // unit) - first).contiguous()


def cut_float(name: str, tensor: torch.Tensor, cut_of: CutOf | None) -> torch.Tensor:
    """A tensor kept in float (norms, the vocabulary, an ignored layer) cut as the float
    checkpoint's is."""
    cut = cut_of(name) if cut_of is not None else None
    if cut is None:
        return tensor
    if isinstance(cut, list):
        return torch.cat([tensor.narrow(*c) for c in cut], dim=cut[0][0])
    return tensor.narrow(*cut).contiguous()


def cut_scale(name: str, scale: torch.Tensor, shape: tuple[int, int], cut: Cut,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """A scale or zero of a `shape` weight cut with it: one per tensor (kept), per output row
    `[out]`/`[out, 1]`, per group of inputs `[out, groups]`, or per `block` (fp8's
    `weight_scale_inv`)."""
    dim, start, size = cut
    if scale.numel() == 1:
        return scale
    if block is not None:
        check(name, shape, cut, block[dim], f"fp8 blocks of {block[0]} x {block[1]}")
        return narrow_units(scale, dim, start, size, block[dim])
    if dim == 0:
        return scale.narrow(0, start, size).contiguous()
    if scale.dim() == 1 or scale.shape[1] == 1:
        return scale  # per row: the whole row's scale serves each shard of its columns
    group = shape[1] // scale.shape[1]
    check(name, shape, cut, group, "groups of its scales")
    return narrow_units(scale, 1, start, size, group)


def cut_parts(name: str, parts: dict[str, torch.Tensor], cut: Cut,
              block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """An 8-bit projection's stored tensors (`weight` `[out, in]` int8 or fp8 and its scales,
    zeros) cut for this rank."""
    weight = parts["weight"]
    shape = (weight.shape[0], weight.shape[1])
    out = dict(parts)
    for leaf in SCALE_PARTS:
        if leaf in parts:
            out[leaf] = cut_scale(name, parts[leaf], shape, cut,
                                  block if leaf == "weight_scale_inv" else None)
    out["weight"] = weight.narrow(*cut).contiguous()
    return out


def cut_int4(name: str, w: CheckpointInt4Weight, cut: Cut) -> CheckpointInt4Weight:
    """AWQ, GPTQ or compressed-tensors 4-bit words cut for this rank: output columns with
    their scales and zero words; input rows with their groups' scales and zeros. With
    activation order (GPTQ `desc_act`) an input shard's rows may use any group, so every
    group's scales and zeros are kept and `g_idx` still indexes them."""
    dim, start, size = cut
    shape = (w.out_features, w.in_features)
    if dim == 0:
        check(name, shape, cut, 8, "int32 words of eight 4-bit zeros along the output")
        qweight = (narrow_units(w.qweight, 1, start, size, 8) if w.awq
                   else w.qweight.narrow(1, start, size).contiguous())
        return replace(w, qweight=qweight, qzeros=narrow_units(w.qzeros, 1, start, size, 8),
                       scales=w.scales.narrow(1, start, size).contiguous(), out_features=size)
    groups = w.scales.shape[0]
    group = w.in_features // groups
    ordered = groups > 1 and torch.equal(w.g_idx.long(),
                                         torch.arange(w.in_features) // group)
    unit = math.lcm(1 if w.awq else 8, group if ordered else 1)
    check(name, shape, cut, unit, "4-bit groups (and GPTQ's eight-code words) along the input"
          if ordered else "int32 words of eight 4-bit codes along the input")
    qweight = (w.qweight.narrow(0, start, size).contiguous() if w.awq
               else narrow_units(w.qweight, 0, start, size, 8))
    g_idx = w.g_idx.narrow(0, start, size).contiguous()
    if not ordered:
        return replace(w, qweight=qweight, g_idx=g_idx, in_features=size)
    first = start // group
    return replace(w, qweight=qweight, qzeros=narrow_units(w.qzeros, 0, start, size, group),
                   scales=narrow_units(w.scales, 0, start, size, group), g_idx=g_idx - first,
                   in_features=size)


def cut_grouped(name: str, codes: torch.Tensor, per_group: tuple[torch.Tensor, ...],
                cut: Cut, what: str) -> tuple[torch.Tensor, ...]:
    """Codes `[out, in]` and their per-group tensors `[out, groups]` (a GGUF tensor's decoded
    blocks) cut for this rank: (codes, *per_group)."""
    dim, start, size = cut
    shape = (codes.shape[0], codes.shape[1])
    if dim == 0:
        return tuple(t.narrow(0, start, size).contiguous() for t in (codes, *per_group))
    group = shape[1] // per_group[0].shape[1]
    check(name, shape, cut, group, what)
    return (codes.narrow(1, start, size).contiguous(),
            *(narrow_units(t, 1, start, size, group) for t in per_group))
