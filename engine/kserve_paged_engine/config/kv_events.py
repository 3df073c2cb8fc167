"""`--kv_events_config`: whether and where the engine publishes KV-cache events (vLLM's keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

PUBLISHERS = ("null", "zmq")


@dataclass(slots=True)
class KVEventsConfig:
    """``--kv_events_config`` (vLLM's JSON keys). Off unless ``enable_kv_cache_events``."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"  # vLLM's default; bound by the engine (PUB side)
    topic: str = ""  # the first frame of every message; SUB sockets filter on its prefix
    hwm: int = 100_000  # messages queued per slow subscriber before ZMQ drops (PUB never blocks)

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config enable_kv_cache_events must be true or false "
                             f"(got {self.enable_kv_cache_events!r})")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of {PUBLISHERS} "
                             f"(got {self.publisher!r})")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError("kv_events_config endpoint must be a ZMQ address such as "
                             f"tcp://*:5557 (got {self.endpoint!r})")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config topic must be a string (got {self.topic!r})")
        if not isinstance(self.hwm, int) or self.hwm < 0:
            raise ValueError(f"kv_events_config hwm must be an integer >= 0 (got {self.hwm!r})")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | dict) -> KVEventsConfig:
        """Parse the flag's JSON; keys of vLLM's that have no use here (replay_endpoint,
        buffer_steps, ...) are ignored, unknown ones are refused."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(data, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key in VLLM_IGNORED_KEYS:
            data.pop(key, None)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown} "
                             f"(known: {sorted(known | VLLM_IGNORED_KEYS)})")
        return cls(**data)


# vLLM's KVEventsConfig keys without an equivalent here (no replay socket, one DP rank).
VLLM_IGNORED_KEYS = frozenset({"replay_endpoint", "buffer_steps", "max_queue_size"})
