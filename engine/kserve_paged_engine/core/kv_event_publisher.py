"""Publish each engine step's KV-cache events on a ZMQ PUB socket (kserve_paged_engine.core.kv_events).

Framing, as vLLM's ZMQ publisher: every message is three frames, ``[topic, sequence, payload]``:
the configured topic (subscribers filter on it), the batch's sequence number as 8 bytes
big-endian (counting from 0, so a subscriber sees a gap when ZMQ dropped a message), and the
msgpack-encoded batch. The socket binds the endpoint or connects to it (see ``binds``) and is
used only by the engine thread. PUB never blocks: a
subscriber that falls ``hwm`` messages behind loses messages, never stalls the engine.
"""

from __future__ import annotations

import logging
import time

from kserve_paged_engine.config.kv_events import KVEventsConfig
from kserve_paged_engine.core.kv_events import KVCacheEvent, encode_batch, int_hashes_from_env

logger = logging.getLogger("kserve_paged_engine")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport is bound (subscribers connect to the
    engine); a named host is connected to, where a central subscriber binds (llm-d's endpoint
    picker listens on :5557 for every pod's events)."""
    scheme, _, rest = endpoint.partition("://")
    return scheme in ("ipc", "inproc") or rest.startswith(("*", "0.0.0.0"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        import zmq  # only when events are switched on

        self.config = config
        self.medium = medium
        self.topic = config.topic.encode()
        self.seq = 0
        self.int_hashes = int_hashes_from_env()
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.binds = binds(config.endpoint)
        try:
            if self.binds:
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_config endpoint {config.endpoint!r}: {exc}") from exc
        # The address actually bound (a tcp port '*' resolves here) or connected to.
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info("publishing KV-cache events %s %s (topic %r)",
                    "on" if self.binds else "to", self.endpoint, config.topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (nothing when there are no events)."""
        if not events:
            return
        payload = encode_batch(time.time(), events, self.medium, self.int_hashes)
        self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload],
                                    copy=False)
        self.seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()
