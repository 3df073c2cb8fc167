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


def join_ranks(rank: int, world: int, port: int, device: torch.device,
               host: str = "127.0.0.1") -> TPRanks:
    """A worker's side of the rendezvous: announce itself in rank 0's store (at `host`: the
    leader pod's address on another node), then join."""
    store = dist.TCPStore(host, port, world, is_master=False, timeout=START_TIMEOUT)
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
    # The same for all-to-alls (expert parallelism's token exchanges).
    exchange_seconds: float = 0.0
    exchanges: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self.reduce_seconds += time.perf_counter() - t0
        self.reduces += 1
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `x` over the ranks, in place (W8A8's activation scales)."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
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

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor,
                   out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Rank r's `in_splits[d]` rows of `x` go to rank d, which receives them as its
        `out_splits[r]` rows of `out` (None: equal splits); gloo and NCCL both have it."""
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        self.exchange_seconds += time.perf_counter() - t0
        self.exchanges += 1
        return out

    def take_exchange_seconds(self) -> tuple[float, int]:
        """(seconds, count) of all-to-alls since the last call."""
        out = (self.exchange_seconds, self.exchanges)
        self.exchange_seconds, self.exchanges = 0.0, 0
        return out

    def take_reduce_seconds(self) -> tuple[float, int]:
        """(seconds, count) of all-reduces since the last call."""
        out = (self.reduce_seconds, self.reduces)
        self.reduce_seconds, self.reduces = 0.0, 0
        return out
