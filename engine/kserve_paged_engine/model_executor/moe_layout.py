"""How a mixture-of-experts layer divides over tensor-parallel ranks (Mixtral, Qwen3-MoE).

Two ways, as vLLM has them:
- Expert sharding (the default under `--tensor_parallel_size N`): every rank holds every
  expert, cut along its intermediate size like a dense MLP (gate/up column-parallel, down
  row-parallel: a contiguous run of the intermediate, as even as possible); the layer's output
  is a partial sum, all-reduced.
- Expert parallelism (`--enable-expert-parallel`): whole experts spread over the ranks, a
  contiguous run each (as even as possible, the first ranks one more: 5 experts over 2 ranks
  are 3 + 2); tokens travel to the ranks owning their experts and back
  (model_executor/expert_parallel.py).

The router is replicated either way. One home of the rule, read by the MoE model, the loader
(which slice of each expert tensor a rank reads) and its start-up checks. No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kserve_paged_engine.model_executor.tp_layout import Cut, split

# A checkpoint's per-expert tensor: (layer prefix, expert, projection). Mixtral's w1/w3/w2 and
# Qwen3-MoE's gate/up/down projections.
EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                       r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Checkpoint projection -> the shard of our stacked weights it fills.
EXPERT_SHARDS = {"w1": "gate", "w3": "up", "w2": "down",
                 "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# A read of nothing: an expert another rank owns (the loader then drops the name).
NOT_HELD: Cut = (0, 0, 0)


def moe_sizes(config: Any) -> tuple[int, int]:
    """(experts per sparse layer, each expert's intermediate size) of a Mixtral or Qwen3-MoE
    config."""
    if getattr(config, "model_type", None) == "mixtral":
        return config.num_local_experts, config.intermediate_size
    return config.num_experts, config.moe_intermediate_size


@dataclass(slots=True, frozen=True)
class ExpertLayout:
    rank: int
    world: int
    num_experts: int
    intermediate_size: int
    expert_parallel: bool

    @classmethod
    def of(cls, config: Any, rank: int, world: int, expert_parallel: bool) -> ExpertLayout:
        """The layout, or ValueError naming what does not split over `world` ranks."""
        num_experts, inter = moe_sizes(config)
        if expert_parallel and num_experts < world:
            raise ValueError(f"enable_expert_parallel: {num_experts} experts cannot be spread "
                             f"over tensor_parallel_size {world} ranks (each rank holds at "
                             "least one expert); drop --enable-expert-parallel to cut each "
                             "expert instead")
        if not expert_parallel and inter < world:
            raise ValueError(f"the experts' intermediate size {inter} is smaller than "
                             f"tensor_parallel_size {world}")
        return cls(rank, world, num_experts, inter, expert_parallel)

    @property
    def experts(self) -> tuple[int, int]:
        """(first expert, count) this rank holds."""
        if self.expert_parallel:
            return split(self.num_experts, self.world, self.rank)
        return 0, self.num_experts

    @property
    def intermediate(self) -> tuple[int, int]:
        """(start, size) of each held expert's intermediate this rank holds."""
        if self.expert_parallel:
            return 0, self.intermediate_size
        return split(self.intermediate_size, self.world, self.rank)

    def holds(self, expert: int) -> bool:
        first, count = self.experts
        return first <= expert < first + count

    def weight_slice(self, hf_name: str, dense: Callable[[str], Any]) -> Any:
        """The cut of checkpoint tensor `hf_name` this rank reads: a per-expert tensor's by the
        rule above (None: all of it; `NOT_HELD`: another rank's expert), any other tensor's by
        `dense` (TPLayout.weight_slice)."""
        m = EXPERT_RE.match(hf_name)
        if m is None:
            return dense(hf_name)
        if self.expert_parallel:
            return None if self.holds(int(m.group(2))) else NOT_HELD
        start, size = self.intermediate
        return (1 if EXPERT_SHARDS[m.group(3)] == "down" else 0), start, size
