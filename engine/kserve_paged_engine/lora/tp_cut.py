"""A PEFT adapter's A/B cut for one tensor-parallel rank, the way the base layer is cut.

The rank's projection is a slice of the unsharded one (model_executor/tp_layout.py), so the
adapter is sliced along the same dimension, as vLLM's punica layers do:

- column-parallel base (q/k/v, gate/up: the rank holds a run of output rows): B keeps the
  same run of rows, A is whole; the rank's delta is exactly its rows of the full delta.
- row-parallel base (o_proj, down_proj: the rank holds a run of input columns and its output
  is a partial sum): A keeps the same run of columns, B is whole; each rank's
  `B (A_r x_r)` is a partial sum of `B (A x)`, added before the layer's all-reduce
  (`RowParallelLinear.partial_hook`), which then sums it with the base's.

An adapter is checked against the unsharded shapes (what PEFT saved) before it is cut.
"""

from __future__ import annotations

from typing import Any

import torch


def full_shape(model: Any, target: str) -> tuple[int, int]:
    """(in_features, out_features) of PEFT target `target` (q_proj, ..., down_proj) in the
    unsharded model of a tensor-parallel `model`."""
    layout = model.layout
    hidden, hd = model.hidden_size, layout.head_dim
    q, kv, inter = layout.num_heads * hd, layout.num_kv_heads * hd, layout.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[target]


def cut_for_rank(model: Any, target: str, a: torch.Tensor, b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of `target` for this rank: B's rows of a column-parallel base, A's columns of a
    row-parallel one (the slice the loader reads of the base weight)."""
    where = model.layout.weight_slice(f"layer.{target}.weight")
    assert where is not None, f"{target} is sharded"
    dim, start, size = where
    if dim == 0:
        return a, b[start:start + size]
    return a[:, start:start + size], b
