"""One step's rows grouped by adapter, and the LoRA delta over all of them at once.

Rows of the flat step batch are sorted by adapter once per step (rows with no adapter left
out); every adapted projection then adds, per adapter present, `(x[rows] @ A.T) @ B.T` into
its rows of the base output. The base GEMM runs once for the whole step, never per adapter, and
weights are never merged.

Three ways to compute the delta. The step's adapters are stacked into slots per projection
(`SlotStacks`, cached by the step's adapter set, so a steady mix stacks once) and every
adapter of the step goes in one call: on CUDA one Triton SGMV shrink and one expand
(`kernels/kserve_paged_kernels/lora_triton.py`), on CPU in fp32 one native call (`kserve_paged_kernels.cpu_native.lora_sgmv`).
Otherwise (bf16 on CPU, no native library), per adapter two torch matmuls (oneDNN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kserve_paged_engine.lora.adapter import LoRAAdapter
from kserve_paged_kernels import cpu_native


@dataclass(slots=True)
class SlotStacks:
    """The weights of a fixed tuple of adapters stacked per projection, slot i = adapter i,
    zero-padded to the largest rank (built on first use of each projection). B is
    `[slots, out, rank]`; `rank_major` stores it as a view of `[slots, rank, out]`, the
    layout the native CPU kernel reads."""

    adapters: tuple[LoRAAdapter, ...]
    rank_major: bool = False
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = field(
        default_factory=dict)

    def get(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if key not in self.stacks:
            weights = [a.weights.get(key) for a in self.adapters]
            present = [w for w in weights if w is not None]
            if not present:
                self.stacks[key] = None
            else:
                rank = max(w.a.shape[0] for w in present)
                ref = present[0]
                a = ref.a.new_zeros(len(weights), rank, ref.a.shape[1])
                if self.rank_major:
                    b = ref.b.new_zeros(len(weights), rank, ref.b.shape[0]).transpose(1, 2)
                else:
                    b = ref.b.new_zeros(len(weights), ref.b.shape[0], rank)
                for i, w in enumerate(weights):
                    if w is not None:
                        a[i, :w.a.shape[0]] = w.a
                        b[i, :, :w.b.shape[1]] = w.b
                self.stacks[key] = (a, b)
        return self.stacks[key]


@dataclass(slots=True)
class SGMVStep:
    """A step's segments on the device, for the Triton kernels (segment i uses slot i)."""

    stacks: SlotStacks
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    scales: torch.Tensor  # ones: the adapters' B is stored scaled
    max_seg_len: int
    backend: str  # "triton" or "native"
    native: cpu_native.LoRASegments | None = None  # the segments checked once, for "native"


@dataclass(slots=True)
class LoRAStep:
    rows: torch.Tensor  # [n] flat-batch rows that carry an adapter, grouped by adapter
    segments: list[tuple[LoRAAdapter, int, int]]  # (adapter, start, end) into `rows`
    sgmv: SGMVStep | None = None  # set on CUDA: the delta runs in the Triton kernels


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


def sgmv_step(segments: list[tuple[LoRAAdapter, int, int]], stacks: SlotStacks,
              device: torch.device, backend: str) -> SGMVStep:
    """The segment tensors of a step whose adapters, in segment order, are `stacks.adapters`,
    for the `backend` kernel ("triton" or "native")."""
    starts = [start for _, start, _ in segments]
    lens = [end - start for _, start, end in segments]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return SGMVStep(stacks, as_tensor(starts), as_tensor(lens), as_tensor(range(len(lens))),
                    torch.ones(len(lens), dtype=torch.float32, device=device), max(lens), backend)


def add_lora_delta(x: torch.Tensor, out: torch.Tensor, step: LoRAStep,
                   key: tuple[int, str]) -> None:
    """out[rows] += scale * B(A(x[rows])) for each adapter of the step that adapts `key`."""
    s = step.sgmv
    if s is not None:
        stacked = s.stacks.get(key)
        if stacked is None:
            return
        if s.backend == "triton":
            from kserve_paged_kernels.lora_triton import lora_sgmv

            lora_sgmv(x, out, stacked[0], stacked[1], s.scales, step.rows, s.seg_start,
                      s.seg_len, s.seg_slot, s.max_seg_len)
            return
        if s.native is None:
            s.native = cpu_native.LoRASegments.build(step.rows, s.seg_start, s.seg_len,
                                                     s.seg_slot, s.scales)
        if s.native is not None and cpu_native.lora_sgmv_segments(
                x, out, stacked[0], stacked[1].transpose(1, 2), s.native):
            return
    xs = x.index_select(0, step.rows)
    for adapter, start, end in step.segments:
        w = adapter.weights.get(key)
        if w is None:
            continue
        delta = torch.mm(torch.mm(xs[start:end], w.a.t()), w.b.t())
        out.index_add_(0, step.rows[start:end], delta)
