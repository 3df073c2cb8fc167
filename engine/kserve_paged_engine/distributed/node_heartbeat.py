"""Heartbeats from worker nodes to the leader, through the rendezvous store (rank 0's TCPStore).

A worker process on the leader's own pod is watched by its process sentinel; one in another
pod has none. So each worker node writes a beat to the store every `BEAT_S`: a token chosen
once per node process and a count. The leader's watcher declares the node gone when its beat
stands still for `SILENCE_S`, or at once when the token changes: a pod that crashed and
restarted within `SILENCE_S` beats on, but its new process's ranks are not in the leader's
process group, so the group's collectives are dead. The leader then fails its readiness with
that reason, as when a local worker process exits. A step in flight with a dead peer fails
sooner (a collective raises when the peer's socket closes).
"""

from __future__ import annotations

import logging
import os
import secrets
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


def node_token() -> str:
    """A token for one node process (pid and random bits: a restarted pod may reuse a pid)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def write_beat(store: dist.Store, node: int, token: str, count: int) -> None:
    store.set(beat_key(node), f"{token} {count}")


def read_beat(store: dist.Store, node: int) -> tuple[str, int] | None:
    """The node's last beat (token, count); None before its first (`get` would block)."""
    key = beat_key(node)
    if not store.check([key]):
        return None
    token, _, count = store.get(key).decode().rpartition(" ")
    return token, int(count)


def start_beating(host: str, port: int, node: int) -> str:
    """Connect to the leader's store and write this process's first beat, then beat from a
    daemon thread; returns the token. Call it before the node's ranks join the group: the
    leader's watcher starts once the group is complete, so the first token it hears is that
    of the process whose ranks it holds."""
    token = node_token()
    store = dist.TCPStore(host, port, is_master=False, timeout=START_TIMEOUT)
    write_beat(store, node, token, 0)
    threading.Thread(target=_beat_forever, args=(store, host, port, node, token),
                     name="kserve-paged-node-beat", daemon=True).start()
    return token


def _beat_forever(store: dist.Store, host: str, port: int, node: int, token: str) -> None:
    """Losing the leader's store ends the node's process after `LOST_LEADER_GRACE_S` (a leader
    that stopped cleanly has sent STOP, and the node has exited 0 by then): its pod restarts
    and the LeaderWorkerSet recreates the group, even where a collective would not notice the
    dead peer (NCCL)."""
    count = 0
    try:
        while True:
            time.sleep(BEAT_S)
            count += 1
            write_beat(store, node, token, count)
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
        start = time.monotonic()
        seen = {node: (read_beat(store, node), start) for node in nodes}
        while not stopped.wait(BEAT_S):
            now = time.monotonic()
            for node, ranks in nodes.items():
                beat = read_beat(store, node)
                last, since = seen[node]
                if last is not None and beat is not None and beat[0] != last[0]:
                    on_silent(f"worker node {node} (tensor-parallel ranks {ranks}) restarted: "
                              "its heartbeat now comes from a new process, whose ranks are not "
                              "in the leader's group")
                    return
                if beat != last:
                    seen[node] = (beat, now)
                elif now - since > SILENCE_S:
                    on_silent(f"worker node {node} (tensor-parallel ranks {ranks}) sent no "
                              f"heartbeat for {SILENCE_S:.0f} s: its pod stopped or cannot "
                              "reach the leader")
                    return
    except Exception as exc:  # noqa: BLE001 - the store closes when the leader stops
        if not stopped.is_set():
            on_silent(f"the leader lost its own rendezvous store: {type(exc).__name__}: {exc}")
