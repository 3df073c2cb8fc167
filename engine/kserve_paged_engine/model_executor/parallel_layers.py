"""The two layers that differ under tensor parallelism; column-parallel projections (qkv,
gate/up) need none: they are plain `Linear`s of fewer output rows.

- `RowParallelLinear`: o_proj and down_proj take this rank's share of the input columns and
  produce a partial sum, all-reduced before the residual add. A bias is loaded on rank 0 only
  (zero elsewhere), so the sum adds it once.
- `VocabParallelEmbedding`: each rank holds a run of token ids; a token outside it looks up
  zeros, and the all-reduce leaves each row its one owner's vector.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_kernels import quant_linear
from kserve_paged_kernels.int8_dynamic import W8A8Weight


class RowParallelLinear(Linear):
    # Called with (input, partial output) before the all-reduce, which then sums what it
    # added too: a LoRA delta of this rank's input columns (engine/kserve_paged_engine/lora/).
    partial_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPRanks) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def quantize(self, weight: quant_linear.QuantWeight) -> None:
        if isinstance(weight, W8A8Weight):  # int8 activations scaled over the whole row
            weight.amax_reduce = self.tp.all_reduce_max
        super().quantize(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x).contiguous()
        if self.partial_hook is not None:
            self.partial_hook(x, out)
        return self.tp.all_reduce(out)


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
