"""The host-memory KV tier (engine/kserve_paged_engine/core/kv_tier/host.py), its logic tested on CPU: built here
through the internal `host_on_cpu` option (on a CPU server `cpu_bytes_to_use` alone adds
nothing, the pool already being in host memory). A tier hit from host memory, or from the disk
below it after a spill, continues as computed; a swapped request comes back through it; the
slots stay bounded by the policy and none leaks.

What holds on every machine type: the restored bytes are the evicted bytes (copies only), so
the float32 answers equal the computed ones whatever the ISA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine import SamplingParams
from kserve_paged_engine.config.kv_tier import NO_TIER, FsTier, KVTierConfig, tier_plan
from kserve_paged_engine.core.kv_events import BlockStored
from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HOST_MEDIUM, HostSlot, HostTier
from kserve_paged_engine.worker.kv_host_copy import SyncCopier, runs
from tests.helpers.kv_tier_engine import PROMPT, Fixed, engine, flood, run, tier_dirs

LONG = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tier_dirs(tmp_path_factory)


def host_config(fs_root=None, policy: str = "lru") -> KVTierConfig:
    fs = (FsTier(str(fs_root)),) if fs_root is not None else ()
    return KVTierConfig(1 << 22, policy, fs, host_on_cpu=True)


def no_leak(tier: HostTier) -> None:
    assert len(tier.slots) + len(tier.free) == tier.capacity_blocks
    assert len(tier.slots) == len(tier.index) <= tier.index.capacity


def test_a_host_tier_hit_continues_as_computed(dirs):
    llm = engine(dirs, "float32", None, kv_transfer_config=host_config(policy="arc"))
    tier = llm.engine.kv_tier
    assert isinstance(tier, HostTier) and tier.lower is None
    first = run(llm, PROMPT)
    flood(llm)
    restored = run(llm, PROMPT)
    s = llm.stats()
    assert s["kv_host_tier_block_hits"] == 10 and restored == first
    assert s["kv_host_tier_read_bytes"] == 10 * tier.block_bytes and "kv_tier_usage" not in s
    no_leak(tier)
    llm.engine.close()


def test_host_evictions_spill_to_the_disk_below_and_come_back(dirs, tmp_path):
    llm = engine(dirs, "float32", None, kv_transfer_config=host_config(tmp_path))
    tier = llm.engine.kv_tier
    tier.index.capacity = 6  # the flood pushes PROMPT's blocks through host memory to disk
    first = run(llm, PROMPT)
    flood(llm)
    events = tier.take_events()
    restored = run(llm, PROMPT)
    s = llm.stats()
    assert s["kv_tier_block_hits"] == 10 and s["kv_host_tier_block_hits"] == 0
    assert restored == first and len(tier.slots) <= 6
    media = {e.medium for e in events if isinstance(e, BlockStored)}
    assert media == {HOST_MEDIUM, "DISK"}
    no_leak(tier)
    llm.engine.close()


def test_a_swap_goes_through_host_memory(dirs):
    prompts = [PROMPT, [(i * 53 + 1000) % 7000 + 20 for i in range(41)]]
    ref = engine(dirs, "float32", None, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, LONG, use_tqdm=False)]
    llm = engine(dirs, "float32", None, kv_transfer_config=host_config())
    llm.engine.kv.tier.swaps.prefill = Fixed(10.0, True)  # a slow prefill: every one swaps
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, LONG, use_tqdm=False)]
    s = llm.stats()
    assert got == want and s["num_preemptions"] > 0
    assert s["kv_swap_ins"] == s["kv_swap_outs"] == s["num_preemptions"]
    assert llm.engine.kv.pool.num_used_blocks == 0 and not llm.engine.kv_tier.private
    no_leak(llm.engine.kv_tier)
    llm.engine.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_slots_stay_bounded_and_spill_in_policy_order(tmp_path, policy):
    lower = DiskTier(tmp_path, 8, 8 * 64, block_size=4, keep_files=False)
    tier = HostTier(8, 8 * 4, 4, policy, lower, pin=False)
    keys = [bytes([i]) * 32 for i in range(12)]
    for i, key in enumerate(keys):
        for _, slot in tier.place([key])[0]:
            tier.host[slot] = i
        no_leak(tier)
    assert len(tier.slots) == 4 and keys[-1] in tier and keys[0] not in tier
    assert tier.fetch(keys[0]) and tier.take(keys[0]) == bytes([0]) * 8  # from the disk
    assert tier.fetch(keys[-1]) and isinstance(tier.take(keys[-1]), HostSlot)
    new = [bytes([100 + i]) * 32 for i in range(6)]  # more new keys than slots in one step
    placed, direct = tier.place(new)
    assert sorted([i for i, _ in placed] + direct) == list(range(6)) and len(placed) <= 4
    tier.spill_rows([new[i] for i in direct], [bytes(8)] * len(direct))  # not in a slot yet
    assert direct and all(new[i] in lower for i in direct)
    tier.private.add(b"p" * 32)
    tier.place([b"p" * 32])
    assert not any(b"p" * 32 in e.block_hashes for e in tier.take_events())
    tier.discard(b"p" * 32)
    assert b"p" * 32 not in tier and not tier.fetch(b"p" * 32) and not tier.private
    no_leak(tier)
    tier.close()


def test_copies_go_by_stretches_of_slots_and_land_in_place():
    """The CUDA copier's batching (one copy per run of consecutive slots), and the CPU
    copier's copies, which take the same rows and slots."""
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []
    host = torch.zeros(8, 4, dtype=torch.uint8)
    rows = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    SyncCopier().save(rows, host, [6, 1, 2])
    assert torch.equal(host[[6, 1, 2]], rows) and not host[0].any()
    assert torch.equal(SyncCopier().load(host, [2, 6], torch.device("cpu")), rows[[2, 0]])


def test_cpu_bytes_make_a_host_tier_on_a_gpu_only():
    cfg = KVTierConfig(1 << 30)
    assert tier_plan(cfg, "cuda").host_bytes == 1 << 30 and tier_plan(cfg, "cuda").fs is None
    with pytest.raises(ValueError, match="no second KV tier"):
        tier_plan(cfg, "cpu")
    assert NO_TIER.startswith("kv_transfer_config leaves no second KV tier")
    older = KVTierConfig.from_json({"kv_connector": "OffloadingConnector",
                                    "kv_connector_extra_config": {"num_cpu_blocks": 5}})
    assert tier_plan(older, "cuda", block_bytes=64).host_bytes == 320
    both = KVTierConfig(1 << 30, fs_tiers=(FsTier("/x"),))
    assert tier_plan(both, "cpu").host_bytes is None and tier_plan(both, "cpu").fs is not None
