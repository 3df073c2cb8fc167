"""The disk tier's store on its own (engine/kserve_paged_engine/core/kv_tier/disk.py, files.py): LRU within its
capacity, files checked on every read (short, flipped or another key's: a miss), folders
apart per model identity, KV events naming the tier's medium, and the config's two forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from kserve_paged_engine.config.kv_tier import KVTierConfig, tier_plan
from kserve_paged_engine.core.kv_events import encode_batch
from kserve_paged_engine.core.kv_tier.disk import TIER_MEDIUM, DiskTier, tier_folder

SIZE = 64


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(SIZE))


def stored(tier: DiskTier, ids: list[int]) -> None:
    tier.store([key(i) for i in ids], [payload(i) for i in ids])
    tier.writer.flush()


def test_blocks_come_back_byte_for_byte_and_the_least_recent_leaves_first(tmp_path: Path):
    tier = DiskTier(tmp_path, SIZE, 3 * SIZE, block_size=4)
    stored(tier, [1, 2, 3])
    assert tier.fetch(key(1))  # 1 is now the most recent
    assert tier.take(key(1)) == payload(1)
    stored(tier, [4])  # evicts 2, the least recent
    assert key(2) not in tier and not (tmp_path / f"{key(2).hex()}.kv").exists()
    assert [k for k in tier.index] == [key(3), key(1), key(4)]
    assert tier.stats.evictions == 1 and tier.usage == 1.0
    tier.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "rename", "delete"])
def test_a_damaged_file_is_a_miss_and_is_forgotten(tmp_path: Path, damage: str):
    tier = DiskTier(tmp_path, SIZE, 10 * SIZE)
    stored(tier, [1, 2])
    path = tmp_path / f"{key(1).hex()}.kv"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-5])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "rename":  # another block's file under this key's name
        path.write_bytes((tmp_path / f"{key(2).hex()}.kv").read_bytes())
    else:
        path.unlink()
    assert not tier.fetch(key(1))
    assert key(1) not in tier and tier.stats.corrupt == 1
    assert tier.fetch(key(2))
    tier.close()


def test_a_new_process_keeps_files_only_with_a_fixed_hash_seed(tmp_path: Path):
    tier = DiskTier(tmp_path, SIZE, 10 * SIZE)
    stored(tier, [1, 2])
    tier.close()
    again = DiskTier(tmp_path, SIZE, 10 * SIZE, keep_files=True)
    assert again.fetch(key(2)) and again.take(key(2)) == payload(2)
    again.close()
    fresh = DiskTier(tmp_path, SIZE, 10 * SIZE, keep_files=False)
    assert fresh.num_blocks == 0 and not list(tmp_path.glob("*.kv"))
    fresh.close()


def test_another_model_or_dtype_gets_another_folder():
    a = tier_folder("/mnt/kv", "model-a|torch.float32|30|3|64|16|sha256|00")
    assert a != tier_folder("/mnt/kv", "model-a|torch.bfloat16|30|3|64|16|sha256|00")
    assert a != tier_folder("/mnt/kv", "model-b|torch.float32|30|3|64|16|sha256|00")
    assert a.parent == Path("/mnt/kv")


def test_the_model_identity_is_its_content_not_its_path(tmp_path: Path):
    """A model folder moved keeps its tier; new weights at the same path get another one."""
    import shutil

    from kserve_paged_engine.core.kv_tier.identity import model_digest

    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "model.safetensors").write_bytes(b"weights")
    (a / ".cache").mkdir()  # what the loader never reads does not count
    shutil.copytree(a, tmp_path / "b")
    same = model_digest(str(a))
    assert model_digest(str(tmp_path / "b")) == same
    (a / "model.safetensors").write_bytes(b"other weights")
    assert model_digest(str(a)) != same
    assert model_digest(str(a), "dummy", 0) != model_digest(str(a), "dummy", 1)


def test_tier_moves_are_kv_events_with_the_tier_medium(tmp_path: Path):
    import msgpack  # a dependency (pyproject.toml): missing, the test must fail

    tier = DiskTier(tmp_path, SIZE, 1 * SIZE, block_size=4)
    stored(tier, [1, 2])  # 2 pushes 1 out
    _, events = msgpack.unpackb(encode_batch(0.0, tier.take_events(), "CPU"))
    assert [e[0] for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert {e[-1] for e in events} == {TIER_MEDIUM}
    tier.close()


def test_a_tier_of_no_block_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(tmp_path, SIZE, SIZE - 1)


def test_the_config_without_a_disk_tier_leaves_none(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # device="cuda" below
    cfg = KVTierConfig.from_json({"kv_connector": "OffloadingConnector",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
    with pytest.raises(ValueError, match="no second KV tier"):
        tier_plan(cfg, "cpu")
    with pytest.raises(ValueError, match="no second KV tier"):
        from kserve_paged_engine.config.engine import EngineConfig
        EngineConfig(kv_transfer_config=cfg, device="cpu")
    assert EngineConfig(kv_transfer_config=cfg, device="cuda").kv_transfer_config == cfg


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_a_policy_keeps_its_capacity_and_accounts_for_every_key(name: str):
    """Random stores, hits and drops against a plain set: what the policy says it let go is
    gone, everything else stored is still there, and it never holds more than its capacity."""
    import random

    from kserve_paged_engine.core.kv_tier.policy import make_policy

    rng = random.Random(7)
    policy, kept = make_policy(name, 8), set()
    for _ in range(5000):
        k = key(rng.randrange(40))
        op = rng.random()
        if op < 0.5 and k not in policy:
            gone = policy.insert(k)
            assert k not in gone and all(g in kept for g in gone)
            kept -= set(gone)
            kept.add(k)
        elif op < 0.9 and k in policy:
            policy.touch(k)
        elif op >= 0.9:
            policy.remove(k)
            kept.discard(k)
        assert set(policy) == kept and len(policy) == len(kept) <= 8


def test_arc_keeps_returning_blocks_through_a_burst_that_lru_lets_push_them_out():
    from kserve_paged_engine.core.kv_tier.policy import make_policy

    def survivors(name: str) -> int:
        policy = make_policy(name, 8)
        hot = [key(i) for i in range(4)]
        for k in hot:
            policy.insert(k)
        for k in hot:
            policy.touch(k)  # each came back once: worth keeping
        for i in range(100, 112):  # a burst of one-off blocks, more than the capacity
            policy.insert(key(i))
        return sum(k in policy for k in hot)

    assert survivors("arc") == 4
    assert survivors("lru") == 0


def test_the_tier_evicts_by_its_policy(tmp_path: Path):
    tier = DiskTier(tmp_path, SIZE, 2 * SIZE, policy="arc")
    stored(tier, [1])
    assert tier.fetch(key(1))  # a hit: 1 moves to ARC's frequent list
    stored(tier, [2, 3])  # 2 leaves, not 1
    assert key(1) in tier and key(2) not in tier and key(3) in tier
    assert not (tmp_path / f"{key(2).hex()}.kv").exists()
    tier.close()


def test_a_lookup_repeated_over_steps_reads_the_file_once(tmp_path: Path, monkeypatch):
    """The head of a full queue looks its prefix up every step: the block read for the first
    lookup is kept (up to STAGED_BYTES), and dropped with the block when the tier lets it go."""
    import kserve_paged_engine.core.kv_tier.disk as kv_tier

    tier = DiskTier(tmp_path, SIZE, 2 * SIZE)
    stored(tier, [1])
    reads = []
    real = kv_tier.read_block
    monkeypatch.setattr(kv_tier, "read_block", lambda *a: reads.append(a) or real(*a))
    for _ in range(3):
        assert tier.fetch(key(1))
        tier.end_step()
    assert len(reads) == 1
    stored(tier, [2, 3])  # 1 leaves the tier: its staged bytes go too
    assert not tier.fetch(key(1)) and key(1) not in tier.staged
    tier.close()
