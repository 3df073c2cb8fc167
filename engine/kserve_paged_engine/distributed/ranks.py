"""The tensor-parallel group: how a process joins it, and the two collectives a layer needs
(an all-reduce of partial sums, a gather of vocabulary shards onto rank 0).

Rank 0 (the engine's process) hosts the rendezvous store; each worker process sets its
`joined_key` there just before joining, so rank 0 can tell a worker that died on the way
from one that is slow. A model built without a group (tensor_parallel_size 1) never calls
the collectives: TP = 1 runs the same modules with no collective and no check per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long rank 0 waits for every worker to join the group (a worker imports torch first).
START_TIMEOUT = timedelta(seconds=300)
# A collective's limit. Workers wait in a broadcast while the server is idle, so it is long:
# death is noticed by process sentinels (both ways), not by this.
COLLECTIVE_TIMEOUT = timedelta(days=30)


def joined_key(rank: int) -> str:
    return f"kserve-paged-tp-joined-{rank}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_ranks(rank: int, world: int, port: int, device: torch.device) -> TPRanks:
    """A worker's side of the rendezvous: announce itself in rank 0's store, then join."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=START_TIMEOUT)
    store.set(joined_key(rank), "1")
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    return TPRanks(rank, world)


@dataclass(slots=True)
class TPRanks:
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
