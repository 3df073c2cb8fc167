"""A worker node: a pod of a multi-node group other than the leader (config/multi_node.py).

It runs no scheduler and no HTTP server: its ranks join the leader's group at
master_addr:master_port and run the steps rank 0 broadcasts, as the worker processes the
leader spawns for its own GPUs do (tp_worker.py). The first of its ranks runs in this process,
the others in spawned processes, all on the `--device` the leader's ranks use (cpu or cuda;
auto: cuda when a GPU is visible). A heartbeat thread tells the leader this node lives, under
a token of this process (distributed/node_heartbeat.py): a restarted pod beats under another
token, and the leader takes that as the node's death. Any of its ranks exiting ends the node
with code 1, so the pod restarts and the leader, hearing no more beats or another token,
fails its readiness with the reason.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import multiprocessing.process
import os
import threading

import torch

from kserve_paged_engine.config.engine import DEVICE_TYPES
from kserve_paged_engine.config.multi_node import NodeLayout
from kserve_paged_engine.distributed.node_heartbeat import start_beating
from kserve_paged_engine.worker.tp_worker import worker_main

logger = logging.getLogger("kserve_paged_engine")


def _exit_when_one_fails(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """A rank that fails ends the node (after STOP they all exit 0: nothing to do)."""
    multiprocessing.connection.wait([p.sentinel for p in procs])
    for p in procs:
        p.join(0.1)
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    if failed:
        logger.error("tensor-parallel rank process %s exited with code %s; stopping the node",
                     failed[0].name, failed[0].exitcode)
        os._exit(1)


def run_worker_node(nodes: NodeLayout, world: int, device_type: str) -> int:
    """Serve this node's ranks on `device_type` (the leader's: "cpu" or "cuda") until the
    leader sends STOP (0) or a rank fails (exits 1). ValueError before anything starts for a
    layout or device this pod cannot run."""
    if nodes.is_leader:
        raise ValueError("node_rank 0 is the leader: it runs the server, not a worker node")
    ranks = nodes.node_ranks(world)
    per = len(ranks)
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device {device_type!r}: a worker node runs its ranks on "
                         f"{' or '.join(DEVICE_TYPES)}")
    if device_type == "cuda" and torch.cuda.device_count() < per:
        raise ValueError(f"device cuda: tensor_parallel_size {world} over {nodes.nnodes} nodes "
                         f"needs {per} GPUs in this pod; {torch.cuda.device_count()} visible")
    threads = max(1, torch.get_num_threads() // per)
    host, port = nodes.master_addr, nodes.master_port
    logger.info("worker node %d of %d: ranks %d..%d of %d on %s, leader %s:%d", nodes.node_rank,
                nodes.nnodes, ranks[0], ranks[-1], world, device_type, host, port)
    start_beating(host, port, nodes.node_rank)  # the first beat before the ranks join
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"kserve-paged-tp{rank}", daemon=True,
                         args=(rank, world, port, device_type, threads, host, rank - ranks[0]))
             for rank in ranks[1:]]
    for p in procs:
        p.start()
    if procs:
        threading.Thread(target=_exit_when_one_fails, args=(procs,), daemon=True).start()
    worker_main(ranks[0], world, port, device_type, threads, host, 0)
    for p in procs:  # STOP reached every rank: they end on their own
        p.join(5.0)
    return 0
