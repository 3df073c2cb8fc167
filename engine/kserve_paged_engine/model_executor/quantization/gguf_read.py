"""`--quantization gguf`'s one read of a GGUF: every tensor once, the quantized projections as
their blocks' groups (for the packed int4/int8 weights), the rest as float tensors.

Why one read: transformers' GGUF loader dequantizes every tensor (and parses the metadata
with `gguf.GGUFReader`, seconds on a tokenizer's worth of strings); reading the raw blocks a
second time to keep them quantized tripled the time to ready. Here the file is indexed once
(engine/kserve_paged_engine/model_executor/quantization/gguf_file.py) and each tensor's bytes are read once.

The names come from the `gguf` package's table (GGUF -> transformers names, for the names our
model expects); what is still transformers' is each architecture's tensor processor (llama.cpp's q/k row
permutation for Llama, Gemma's norm offset). A quantized projection's row order is found by
running the processor on its row numbers; a processor that does more than reorder rows
leaves that tensor dequantized (float, as transformers would give it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kserve_paged_engine.model_executor.quantization import gguf_blocks
from kserve_paged_engine.model_executor.quantization.gguf_file import RawTensor, read_index
from kserve_paged_engine.model_executor.quantization.tp_cuts import (
    Cut,
    CutOf,
    cut_float,
    cut_grouped,
    one_cut,
)


@dataclass(slots=True)
class GGUFTensor:
    """One GGUF projection: its block type, and for a 4-bit type (codes, scale, minimum), for
    Q8_0 and Q6_K (codes, scale), per group in transformers' row order."""

    qtype: str
    rows: int
    int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    int8: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class GGUFRead:
    """The file read once: every tensor as float32 by transformers' parameter name, streamed,
    and the projections' groups by transformers' module name (no `.weight`), filled as the
    stream is read."""

    groups: dict[str, GGUFTensor]
    weights: Iterator[tuple[str, torch.Tensor]]


def _name_map(architecture: str, config: Any, expected: set[str]) -> dict[str, str]:
    """GGUF tensor name -> transformers' parameter name, for the names the model expects
    (`gguf`'s own table, which transformers' loader reads too)."""
    import gguf

    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if architecture not in archs:
        raise ValueError(f"GGUF architecture {architecture!r} is unknown to the gguf package")
    table = gguf.get_tensor_name_map(archs[architecture], config.num_hidden_layers)
    names = {}
    for hf_name in expected:
        key, dot, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(key)
        if gguf_name is not None and dot:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _processor(architecture: str, config: Any) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _processed(processor: Any, weights: np.ndarray, name: str, names: dict[str, str]) -> Any:
    return processor.process(weights=weights, name=name, tensor_key_mapping=names,
                             parsed_parameters={"tensors": {}, "config": {}})


def _row_order(processor: Any, name: str, rows: int, names: dict[str, str]
               ) -> np.ndarray | None:
    """`hf[i] = stored[order[i]]` for a tensor the processor only reorders by rows (llama.cpp's
    q/k permutation); None when it does anything else to it."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    out = _processed(processor, probe, name, names)
    if out.name != name or out.weights.shape != probe.shape:
        return None
    order = np.asarray(out.weights).reshape(rows)
    if not np.array_equal(np.sort(order), probe.reshape(rows)):
        return None
    return order.astype(np.int64)


def _quantized(raw: RawTensor, order: np.ndarray, need_float: bool
               ) -> tuple[GGUFTensor, np.ndarray | None]:
    """A 4-bit or int8-read tensor's groups in transformers' row order, and with `need_float`
    its float32 weight from them (what `gguf.dequantize` computes, row for row)."""
    rows, cols = raw.shape
    entry = GGUFTensor(raw.qtype.name, rows)
    if raw.qtype in gguf_blocks.INT4_TYPES:
        codes, scale, minimum = (a[order] for a in gguf_blocks.int4_groups(
            raw.data, raw.qtype, rows, cols))
        entry.int4 = tuple(torch.from_numpy(np.ascontiguousarray(a))  # type: ignore[assignment]
                           for a in (codes, scale, minimum))
        if not need_float:
            return entry, None
        deq = (codes.astype(np.float32).reshape(*scale.shape, -1) * scale[..., None]
               + minimum[..., None])
    else:
        codes, scale = (a[order] for a in gguf_blocks.int8_groups(raw.data, rows, cols,
                                                                   raw.qtype))
        entry.int8 = tuple(torch.from_numpy(np.ascontiguousarray(a))  # type: ignore[assignment]
                           for a in (codes, scale))
        deq = codes.astype(np.float32).reshape(*scale.shape, -1) * scale[..., None]
    return entry, deq.reshape(rows, cols)


def _dequantized(raw: RawTensor, processor: Any, names: dict[str, str]) -> np.ndarray:
    from gguf.quants import dequantize

    weights = dequantize(raw.data, raw.qtype).reshape(raw.shape)
    return np.asarray(_processed(processor, weights, raw.name, names).weights)


_READ_AS_GROUPS = (*gguf_blocks.INT4_TYPES, *gguf_blocks.INT8_TYPES)


def _sure_int4(plan: dict[str, tuple[RawTensor, np.ndarray | None]]) -> set[str]:
    """transformers' weight names of the decoder projections packed as int4 whatever the
    dtype: every part of their fused projection (q/k/v, gate/up) a 4-bit type read as groups.
    Their float weight is never used, so it is not computed (`read` streams a stand-in). The
    embedding and LM head are not among them: they are served from their float weight
    (re-quantized per row, or float under tensor parallelism)."""
    from kserve_paged_engine.model_executor.quantization.layouts import FUSED_PARTS

    siblings = {p: parts for parts in FUSED_PARTS.values() for p in parts}
    sure = set()
    for hf_name in plan:
        if not hf_name.startswith("model.layers."):
            continue
        module, _, leaf = hf_name.removesuffix(".weight").rpartition(".")
        parts = [f"{module}.{p}.weight" for p in siblings.get(leaf, (leaf,))]
        if all(p in plan and plan[p][1] is not None
               and plan[p][0].qtype in gguf_blocks.INT4_TYPES for p in parts):
            sure.add(hf_name)
    return sure


def read(path: Path, config: Any, expected: set[str], cut: CutOf | None = None) -> GGUFRead:
    """The file the model expects (`expected`: transformers' parameter names), each tensor read
    once as `weights` is consumed (which fills `groups`); ValueError for an architecture the
    gguf package does not know. `config`: the model's transformers config (the GGUF's own or
    its folder's). `cut`: tensor parallelism's cut of each tensor (`TPLayout.weight_slice`),
    the groups cut with their codes (tp_cuts.py)."""
    index = read_index(path)
    processor = _processor(index.architecture, config)
    names = _name_map(index.architecture, config, expected)
    plan: dict[str, tuple[RawTensor, np.ndarray | None]] = {}
    for raw in index.tensors.values():
        hf_name = names.get(raw.name)
        if hf_name is None:
            continue  # nothing of the model's (e.g. rope_freqs)
        order = None
        if raw.qtype in _READ_AS_GROUPS and len(raw.shape) == 2:
            order = _row_order(processor, raw.name, raw.shape[0], names)
        plan[hf_name] = (raw, order)
    out = GGUFRead({}, iter(()))
    out.weights = _stream(plan, _sure_int4(plan), out.groups, processor, names, cut)
    return out


def _cut_entry(key: str, entry: GGUFTensor, cut: Cut) -> GGUFTensor:
    """A projection's groups cut for one tensor-parallel rank."""
    what = f"groups of its {entry.qtype} blocks"
    if entry.int4 is not None:
        codes, scale, minimum = entry.int4
        entry.int4 = cut_grouped(key, codes, (scale, minimum), cut, what)  # type: ignore[assignment]
    if entry.int8 is not None:
        codes, scale = entry.int8
        entry.int8 = cut_grouped(key, codes, (scale,), cut, what)  # type: ignore[assignment]
    if cut[0] == 0:
        entry.rows = cut[2]
    return entry


def _stream(plan: dict[str, tuple[RawTensor, np.ndarray | None]], sure_int4: set[str],
            groups: dict[str, GGUFTensor], processor: Any, names: dict[str, str],
            cut: CutOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) per tensor, one at a time, each this rank's cut under tensor
    parallelism; a sure int4 projection's tensor is a zero stand-in of its shape (nothing
    computed, nothing allocated)."""
    for hf_name, (raw, order) in plan.items():
        key = hf_name.removesuffix(".weight")
        if order is None:
            weights = _dequantized(raw, processor, names)
            if hf_name.endswith(".weight") and len(raw.shape) == 2:  # its type, for the log
                groups[key] = GGUFTensor(raw.qtype.name, raw.shape[0])
                part = cut(hf_name) if cut is not None else None
                if isinstance(part, tuple) and part[0] == 0:  # this rank's rows (fused parts)
                    groups[key].rows = part[2]
        else:
            entry, weights = _quantized(raw, order, hf_name not in sure_int4)
            part = one_cut(key, cut(hf_name)) if cut is not None else None
            groups[key] = entry if part is None else _cut_entry(key, entry, part)
            if weights is None:
                shape = list(raw.shape)
                if part is not None:
                    shape[part[0]] = part[2]
                yield hf_name, torch.zeros((), dtype=torch.float32).expand(*shape)
                continue
        tensor = torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))
        yield hf_name, cut_float(hf_name, tensor, cut)
