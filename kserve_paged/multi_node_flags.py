"""Multi-node flags: vLLM's `--nnodes`, `--node-rank`, `--master-addr`, `--master-port` (a
LeaderWorkerSet's `LWS_*` variables when they are not given, engine config/multi_node.py),
`--headless`, and vLLM's data-parallel flags: `--data_parallel_size N` runs N engine replicas
in this server (engine frontend/dp_router.py); data parallelism across pods is refused
(docs/tensor_parallel.md, "Data parallel").

A process whose node rank is above 0 is a worker node: `run_if_worker_node` serves its ranks
and no HTTP server starts.
"""

from __future__ import annotations

import argparse
from typing import Any

from kserve_paged.flag_types import positive_int
from kserve_paged_engine.config.multi_node import (
    DEFAULT_MASTER_PORT,
    LWS_GROUP_SIZE,
    LWS_LEADER_ADDRESS,
    LWS_WORKER_INDEX,
    NodeLayout,
    resolve_layout,
)

DATA_PARALLEL_PODS_REFUSAL = (
    "data_parallel_size {size} with data_parallel_size_local {local}: data parallelism "
    "across pods is not built; run all {size} replicas in one pod (data == dataLocal), or "
    "more pods as LLMInferenceService spec.replicas behind the InferencePool")


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {text}")
    return port


def add_multi_node_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node")
    group.add_argument("--nnodes", type=positive_int, default=None,
                       help=f"Pods the tensor-parallel ranks span (default: ${LWS_GROUP_SIZE}, "
                            "else 1). --tensor_parallel_size must be a multiple of it.")
    group.add_argument("--node_rank", type=int, default=None,
                       help=f"This pod's place, 0 = the leader that serves HTTP (default: "
                            f"${LWS_WORKER_INDEX}, else 0). Above 0: a worker node, no HTTP "
                            "server.")
    group.add_argument("--master_addr", default=None,
                       help=f"The leader's address (default: ${LWS_LEADER_ADDRESS}, else "
                            "127.0.0.1).")
    group.add_argument("--master_port", type=_port, default=None,
                       help="The leader's rendezvous port; a LeaderWorkerSet sets none "
                            f"(default {DEFAULT_MASTER_PORT}, as vLLM's).")
    group.add_argument("--headless", action="store_true",
                       help="vLLM's mark of a worker node; the node rank decides here.")
    group.add_argument("--data_parallel_size", type=positive_int, default=1,
                       help="Engine replicas in this server, each with its own scheduler, KV "
                            "cache and model copy; a request goes to the least-loaded one "
                            "(CPU: threads split between them; CUDA: replica r on GPU r). "
                            "tensor_parallel_size 1 only.")
    group.add_argument("--data_parallel_size_local", type=positive_int, default=None,
                       help="vLLM's replicas in this pod; must equal --data_parallel_size "
                            "(default) since data parallelism across pods is not built.")
    group.add_argument("--data_parallel_start_rank", type=int, default=None,
                       help="vLLM's; 0 (or unset) only: a pod holds every replica.")
    group.add_argument("--data_parallel_rpc_port", type=int, default=None,
                       help="vLLM's; accepted, unused in one pod.")
    group.add_argument("--data_parallel_address", default=None,
                       help="vLLM's; accepted, unused in one pod.")


def data_parallel_size(args: argparse.Namespace) -> int:
    """The replicas this server runs; ValueError for a layout over pods (not built)."""
    size = getattr(args, "data_parallel_size", 1)
    local = getattr(args, "data_parallel_size_local", None)
    start = getattr(args, "data_parallel_start_rank", None)
    if (local is not None and local != size) or (start or 0) != 0:
        raise ValueError(DATA_PARALLEL_PODS_REFUSAL.format(
            size=size, local=local if local is not None else f"{size} (start rank {start})"))
    return size


def node_layout(args: argparse.Namespace) -> NodeLayout | None:
    """The layout the flags and the environment give; ValueError for one that cannot run
    (data parallelism beside tensor parallelism or several pods included)."""
    layout = resolve_layout(getattr(args, "nnodes", None), getattr(args, "node_rank", None),
                            getattr(args, "master_addr", None), getattr(args, "master_port", None))
    if (size := data_parallel_size(args)) > 1:
        from kserve_paged_engine.frontend.dp_router import check_data_parallel

        check_data_parallel(size, getattr(args, "tensor_parallel_size", 1), layout)
    return layout


def multi_node_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig option the flags carry (none for one node)."""
    layout = node_layout(args)
    return {} if layout is None else {"multi_node": layout}


def run_if_worker_node(args: argparse.Namespace) -> int | None:
    """Serve a worker node's ranks and return its exit code; None on the leader."""
    layout = node_layout(args)
    if layout is None or layout.is_leader:
        return None
    from kserve_paged_engine.core.kv_sizing import resolve_device
    from kserve_paged_engine.worker.worker_node import run_worker_node

    layout.ranks_per_node(args.tensor_parallel_size)  # parse_args checked it; a clear error
    device = resolve_device(args.device)  # the leader's rule for --device
    return run_worker_node(layout, args.tensor_parallel_size, device.type)
