"""vLLM's ``--kv-transfer-config`` as KServe writes it for ``spec.kvCacheOffloading``: which
second KV tier to build (engine/kserve_paged_engine/core/kv_tier/disk.py).

Two forms are accepted, both with ``"kv_connector": "OffloadingConnector"``:

- KServe 0.20's rendering: ``kv_connector_extra_config`` with ``"spec_name":
  "TieringOffloadingSpec"``, ``cpu_bytes_to_use``, ``eviction_policy`` (``lru`` or ``arc``) and
  ``secondary_tiers``, a list of ``{"type": "fs", "root_dir": "/mnt/kv-cache-0"}`` (one: a
  cascade between disks is refused, `MANY_TIERS` says why);
- vLLM's simpler one, with only ``cpu_bytes_to_use`` (or the older ``num_cpu_blocks``).

Where the tiers go is decided at start-up, when the device is known (`tier_plan`): on a GPU
``cpu_bytes_to_use`` makes a host-memory tier (engine/kserve_paged_engine/core/kv_tier/host.py) with the ``fs`` tier,
if any, below it; on a CPU server the pool already lives in host memory, so a host tier adds
nothing and the first ``fs`` tier is the second tier; a config that leaves no second tier is an
error. Other connectors
(LMCache, NIXL, P/D disaggregation) are refused by name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("kserve_paged_engine")

CONNECTOR = "OffloadingConnector"
SPEC_NAMES = ("TieringOffloadingSpec", "CPUOffloadingSpec")
EVICTION_POLICIES = ("lru", "arc")
TIER_TYPES = ("fs",)
ROLES = ("kv_both",)


NO_TIER = ("kv_transfer_config leaves no second KV tier: on a CPU server the KV pool already "
           "lives in host memory, so cpu_bytes_to_use adds none (on a GPU it makes a "
           "host-memory tier); add secondary_tiers "
           '[{"type": "fs", "root_dir": "/mnt/kv-cache-0"}] (spec.kvCacheOffloading\'s '
           "file-system tiers)")


MANY_TIERS = ("kv_transfer_config: {} fs tiers given; this engine keeps one disk tier under "
              "its KV pool and builds no cascade between disks (on one node a block moved to a "
              "second local volume costs a read and a write for a copy the first could have "
              "kept): give one root_dir, the largest fast volume, and size it (capacity_bytes, "
              "or the volume's free space)")


@dataclass(frozen=True, slots=True)
class FsTier:
    root_dir: str
    capacity_bytes: int | None = None  # ours; None: 90% of the folder's free disk at start


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    cpu_bytes_to_use: int | None = None
    eviction_policy: str = "lru"
    fs_tiers: tuple[FsTier, ...] = field(default_factory=tuple)
    # Internal (tests): build the host-memory tier on a CPU server too, to test its logic.
    host_on_cpu: bool = False
    num_cpu_blocks: int | None = None  # vLLM's older form of the host tier's size

    def host_bytes(self, block_bytes: int) -> int | None:
        """The host tier's size: cpu_bytes_to_use, else num_cpu_blocks blocks (None: none)."""
        if self.cpu_bytes_to_use:
            return self.cpu_bytes_to_use
        return self.num_cpu_blocks * block_bytes if self.num_cpu_blocks else None

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> KVTierConfig:
        """Parse the flag's JSON (ValueError naming what is wrong)."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        connector = data.get("kv_connector")
        if connector != CONNECTOR:
            raise ValueError(f"kv_transfer_config: kv_connector {connector!r} is not supported "
                             f"(only {CONNECTOR!r}, KV offloading to a second tier)")
        role = data.get("kv_role", "kv_both")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {ROLES} (got {role!r})")
        extra = data.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        return cls._from_extra(extra)

    @classmethod
    def _from_extra(cls, extra: dict[str, Any]) -> KVTierConfig:
        spec = extra.get("spec_name", SPEC_NAMES[0])
        if spec not in SPEC_NAMES:
            raise ValueError(f"kv_transfer_config: spec_name must be one of {SPEC_NAMES} "
                             f"(got {spec!r})")
        policy = extra.get("eviction_policy", "lru")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_transfer_config: eviction_policy must be one of "
                             f"{EVICTION_POLICIES} (got {policy!r})")
        cpu, blocks = extra.get("cpu_bytes_to_use"), extra.get("num_cpu_blocks")
        for name, n in (("cpu_bytes_to_use", cpu), ("num_cpu_blocks", blocks)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                raise ValueError(f"kv_transfer_config: {name} must be a non-negative integer "
                                 f"(got {n!r})")
        tiers = extra.get("secondary_tiers") or []
        if not isinstance(tiers, list):
            raise ValueError("kv_transfer_config: secondary_tiers must be a list")
        fs = tuple(_fs_tier(t) for t in tiers)
        if len(fs) > 1:
            raise ValueError(MANY_TIERS.format(len(fs)))
        return cls(cpu, policy, fs, num_cpu_blocks=blocks)


def _fs_tier(entry: Any) -> FsTier:
    if not isinstance(entry, dict) or entry.get("type") not in TIER_TYPES:
        raise ValueError("kv_transfer_config: each secondary tier must be "
                         f'{{"type": "fs", "root_dir": ...}} (got {entry!r})')
    root = entry.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ValueError(f"kv_transfer_config: an fs tier needs a root_dir (got {entry!r})")
    cap = entry.get("capacity_bytes")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise ValueError(f"kv_transfer_config: capacity_bytes must be a positive integer "
                         f"(got {cap!r})")
    return FsTier(root, cap)


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What goes under the pool: host memory (bytes, or None) above an fs tier (or None)."""

    host_bytes: int | None
    fs: FsTier | None


def tier_plan(config: KVTierConfig, device_type: str, block_bytes: int = 1,
              tensor_parallel: bool = False) -> TierPlan:
    """The tiers this engine builds under its pool on this device, or a ValueError saying
    why the config leaves none. Under tensor parallelism only the fs tier is built (its
    files hold every rank's heads: engine/kserve_paged_engine/worker/tp_tier.py)."""
    host = config.host_bytes(block_bytes)
    if host and tensor_parallel:
        logger.info("kv_transfer_config: the host-memory tier is not built under tensor "
                    "parallelism; the fs tier is the second tier")
        host = None
    if host and device_type == "cpu" and not config.host_on_cpu:
        logger.info("kv_transfer_config: a host tier adds nothing on a CPU server "
                    "(the KV pool already lives in host memory); the fs tier is the "
                    "second tier")
        host = None
    fs = config.fs_tiers[0] if config.fs_tiers else None
    if host is None and fs is None:
        raise ValueError(NO_TIER)
    return TierPlan(host, fs)
