"""The two layers that differ under tensor parallelism; column-parallel projections (qkv,
gate/up) need none: they are plain `Linear`s of fewer output rows.

- `RowParallelLinear`: o_proj and down_proj take this rank's share of the input columns and
  produce a partial sum, all-reduced before the residual add. A bias is loaded on rank 0 only
  (zero elsewhere), so the sum adds it once.
- `VocabParallelEmbedding`: each rank holds a run of token ids; a token outside it looks up
  zeros, and the all-reduce leaves each row its one owner's vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.layers import Linear


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPRanks) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: int, hidden_size: int, first_id: int, tp: TPRanks) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.first_id = first_id
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, first_id={self.first_id}"
