"""Heartbeats from worker nodes to the leader, through the rendezvous store (rank 0's TCPStore).

A worker process on the leader's own pod is watched by its process sentinel; one in another
pod has none. So each worker node bumps a counter in the store every `BEAT_S`, and the
leader's watcher declares the node gone when its counter stands still for `SILENCE_S`: the
leader then fails its readiness with that reason, as when a local worker process exits. A step
in flight with a dead peer fails sooner (a collective raises when the peer's socket closes).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from kserve_paged_engine.distributed.ranks import START_TIMEOUT

logger = logging.getLogger("kserve_paged_engine")

BEAT_S = 1.0
# Long enough for a busy host to miss a few beats, short against a readiness probe's period.
SILENCE_S = 10.0
LOST_LEADER_GRACE_S = 5.0


def beat_key(node: int) -> str:
    return f"kserve-paged-node-beat-{node}"


def beat_forever(host: str, port: int, node: int) -> None:
    """A worker node's beat (a daemon thread's target). Losing the leader's store ends the
    node's process after `LOST_LEADER_GRACE_S` (a leader that stopped cleanly has sent STOP,
    and the node has exited 0 by then): its pod restarts and the LeaderWorkerSet recreates
    the group, even where a collective would not notice the dead peer (NCCL)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=START_TIMEOUT)
        while True:
            store.add(beat_key(node), 1)
            time.sleep(BEAT_S)
    except Exception as exc:  # noqa: BLE001 - the leader is gone, whatever the error
        time.sleep(LOST_LEADER_GRACE_S)
        logger.error("worker node %d lost the leader's store at %s:%d: %s", node, host, port, exc)
        os._exit(1)


def watch_nodes(port: int, nodes: dict[int, str], stopped: threading.Event,
                on_silent: Callable[[str], None]) -> None:
    """The leader's watcher (a daemon thread's target): `nodes` maps each worker node to the
    ranks it runs (for the message); `on_silent` gets the reason once, then the watch ends."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=START_TIMEOUT)
        seen = {node: (store.add(beat_key(node), 0), time.monotonic()) for node in nodes}
        while not stopped.wait(BEAT_S):
            now = time.monotonic()
            for node, ranks in nodes.items():
                count = store.add(beat_key(node), 0)
                if count != seen[node][0]:
                    seen[node] = (count, now)
                elif now - seen[node][1] > SILENCE_S:
                    on_silent(f"worker node {node} (tensor-parallel ranks {ranks}) sent no "
                              f"heartbeat for {SILENCE_S:.0f} s: its pod stopped or cannot "
                              "reach the leader")
                    return
    except Exception as exc:  # noqa: BLE001 - the store closes when the leader stops
        if not stopped.is_set():
            on_silent(f"the leader lost its own rendezvous store: {type(exc).__name__}: {exc}")
