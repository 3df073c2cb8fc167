"""`--quantization int4|int8|fp8` (quantized at load) under tensor parallelism, giving each rank
the codes TP = 1 would have given its share.

A scale taken over a rank's shard would differ from TP = 1's where it spans the cut: int8's one
scale per output row (a row-parallel projection's rows are cut), fp8's one scale per (fused)
projection. So each rank reads the projections whole, keeps the max |w| of each of its rows
over all the row's columns, and cuts the float weight after; the pickers scale with those.
int4's groups of 32 inputs are the rank's own when the cut falls on a group boundary, and a
cut that does not is refused (tp_cuts.check), as a checkpoint's groups are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kserve_paged_engine.model_executor.quantization.layouts import INT4_GROUP, hf_parts
from kserve_paged_engine.model_executor.quantization.tp_cuts import (
    CutOf,
    check,
    cut_float,
    one_cut,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class WholeRows:
    """The max |w| of every row this rank holds, over the whole row, by transformers'
    projection name; filled as `stream` cuts the whole tensors it reads."""

    cut: CutOf
    method: str
    amax: dict[str, torch.Tensor] = field(default_factory=dict)
    peak: dict[str, float] = field(default_factory=dict)  # max |w| of the whole tensor

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if (leaf == "weight" and prefix.startswith("model.layers.")
                    and prefix.endswith(PROJECTIONS) and tensor.dim() == 2):
                self._record(prefix, tensor)
            yield name, cut_float(name, tensor, self.cut)

    def _record(self, prefix: str, whole: torch.Tensor) -> None:
        cut = one_cut(prefix, self.cut(f"{prefix}.weight"))
        rows = whole.detach().float().abs().amax(dim=1)
        self.peak[prefix] = float(rows.max())
        if cut is not None and cut[0] == 0:
            rows = rows.narrow(0, cut[1], cut[2])
        elif (cut is not None and self.method == "int4"
              and whole.shape[1] % INT4_GROUP == 0):
            check(prefix, (whole.shape[0], whole.shape[1]), cut, INT4_GROUP,
                  "groups --quantization int4 quantizes in")
        self.amax[prefix] = rows.contiguous()

    def rows(self, name: str) -> torch.Tensor | None:
        """Our projection's (fused: its parts stacked) max |w| per row, or None if unread."""
        parts = [self.amax.get(p) for p in hf_parts(name)]
        if any(p is None for p in parts):
            return None
        return torch.cat(parts)  # type: ignore[arg-type]

    def tensor_peak(self, name: str) -> float | None:
        """Our projection's max |w| over every rank's rows (fp8's one scale), or None."""
        parts = [self.peak.get(p) for p in hf_parts(name)]
        return None if any(p is None for p in parts) else max(parts)  # type: ignore[type-var]
