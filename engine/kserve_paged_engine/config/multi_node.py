"""Multi-node tensor parallelism: which pod this process is, and where the group meets.

KServe's LLMInferenceService lays a model over several pods with a LeaderWorkerSet, which sets
`LWS_LEADER_ADDRESS` (the leader pod's DNS name), `LWS_GROUP_SIZE` (pods in the group, leader
included) and `LWS_WORKER_INDEX` (0 on the leader) in every pod. It sets no port, so the port
is the `--master_port` flag, default `DEFAULT_MASTER_PORT` (vLLM's `--master-port` default).
vLLM's own flags (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`) say the same
and win over the variables. Node 0 (the leader) runs the engine and hosts the rendezvous store;
node k runs the tensor-parallel ranks k * R .. k * R + R - 1 (R = ranks per node) and no
scheduler (engine/kserve_paged_engine/worker/worker_node.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# The variables a LeaderWorkerSet sets in each pod of a group.
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
DEFAULT_MASTER_PORT = 29501  # vLLM's --master-port default; LWS sets no port
DEFAULT_MASTER_ADDR = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """The pods of one tensor-parallel group and this process's place among them."""

    nnodes: int
    node_rank: int
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1 (got {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1} (got {self.node_rank})")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 1..65535 (got {self.master_port})")
        if not self.master_addr:
            raise ValueError("master_addr is empty: the leader's address is needed "
                             f"(--master_addr or {LWS_LEADER_ADDRESS})")

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def ranks_per_node(self, world: int) -> int:
        """Ranks each node runs; ValueError unless the nodes split `world` evenly."""
        if world % self.nnodes:
            raise ValueError(f"tensor_parallel_size {world} must be a multiple of nnodes "
                             f"{self.nnodes}: every node runs the same number of ranks")
        return world // self.nnodes

    def node_ranks(self, world: int) -> range:
        """The tensor-parallel ranks this node runs."""
        per = self.ranks_per_node(world)
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def node_of(self, rank: int, world: int) -> int:
        return rank // self.ranks_per_node(world)


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number") from None


def resolve_layout(nnodes: int | None = None, node_rank: int | None = None,
                   master_addr: str | None = None, master_port: int | None = None,
                   env: Mapping[str, str] | None = None) -> NodeLayout | None:
    """The layout from vLLM's flags (None: not given), else the LeaderWorkerSet's variables;
    None for one node."""
    env = os.environ if env is None else env
    nodes = nnodes if nnodes is not None else _env_int(env, LWS_GROUP_SIZE)
    if nodes is None or nodes == 1:
        if node_rank:
            raise ValueError(f"node_rank {node_rank} needs nnodes > 1")
        return None
    rank = node_rank if node_rank is not None else _env_int(env, LWS_WORKER_INDEX)
    return NodeLayout(nodes, rank or 0,
                      master_addr or env.get(LWS_LEADER_ADDRESS) or DEFAULT_MASTER_ADDR,
                      master_port or DEFAULT_MASTER_PORT)
