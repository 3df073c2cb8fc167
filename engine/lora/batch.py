"""One step's rows grouped by adapter, and the LoRA delta over all of them at once.

Rows of the flat step batch are sorted by adapter once per step (rows with no adapter left
out); every adapted projection then adds, per adapter present, `(x[rows] @ A.T) @ B.T` into
its rows of the base output. The base GEMM runs once for the whole step, never per adapter, and
weights are never merged. The shrink/expand here are torch matmuls (oneDNN on CPU, cuBLAS on
CUDA). `kernels/lora_triton.py` has the SGMV shrink/expand for CUDA over stacked adapter slots,
tested against its reference in Triton's interpreter; the engine does not call it yet (that
needs the adapters of a step stacked into slots on the GPU), nor is there a native grouped GEMM
on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.lora.adapter import LoRAAdapter


@dataclass(slots=True)
class LoRAStep:
    rows: torch.Tensor  # [n] flat-batch rows that carry an adapter, grouped by adapter
    segments: list[tuple[LoRAAdapter, int, int]]  # (adapter, start, end) into `rows`


def group_rows(token_ids: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Per-token adapter ids (0: none) -> rows sorted by adapter and (id, start, end) runs."""
    rows = np.flatnonzero(token_ids)
    if rows.size == 0:
        return rows, []
    rows = rows[np.argsort(token_ids[rows], kind="stable")]
    ids = token_ids[rows]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [ids.size]))
    return rows, [(int(ids[s]), int(s), int(e)) for s, e in zip(starts, ends)]


def add_lora_delta(x: torch.Tensor, out: torch.Tensor, step: LoRAStep,
                   key: tuple[int, str]) -> None:
    """out[rows] += scale * B(A(x[rows])) for each adapter of the step that adapts `key`."""
    xs = x.index_select(0, step.rows)
    for adapter, start, end in step.segments:
        w = adapter.weights.get(key)
        if w is None:
            continue
        delta = torch.mm(torch.mm(xs[start:end], w.a.t()), w.b.t())
        out.index_add_(0, step.rows[start:end], delta)
