"""The tensor-parallel group as the model sees it: its rank and the two collectives a layer
needs (an all-reduce of partial sums, a gather of vocabulary shards onto rank 0).

A model built without a group (tensor_parallel_size 1) never calls these: TP = 1 runs the
same modules with no collective and no check per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TPGroup:
    rank: int
    world_size: int
    # Wall time spent in all-reduces since the last `take_reduce_seconds` (benchmarks read it).
    reduce_seconds: float = 0.0
    reduces: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self.reduce_seconds += time.perf_counter() - t0
        self.reduces += 1
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim, on rank 0 (None elsewhere)."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def take_reduce_seconds(self) -> tuple[float, int]:
        """(seconds, count) of all-reduces since the last call."""
        out = (self.reduce_seconds, self.reduces)
        self.reduce_seconds, self.reduces = 0.0, 0
        return out
