"""The disk tier's folder as untrusted storage (engine/kserve_paged_engine/core/kv_tier/files.py, disk.py, issue 49):
a link planted where the writer writes or the reader reads is never followed, a FIFO planted
as a block file is a miss at once (it cannot block the engine thread), a restart on a folder
holding a dangling link, garbage, a folder or a truncated file starts and skips them, and a
block whose header names another model or layout is a miss, counted."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kserve_paged_engine.core.kv_tier.disk import DiskTier

SIZE = 64
GUARD_S = 30  # a blocked read's thread is given up on after this (a guard, not a timing)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(SIZE))


def block_file(folder: Path, i: int) -> Path:
    return folder / f"{key(i).hex()}.kv"


def stored(tier: DiskTier, ids: list[int]) -> None:
    tier.store([key(i) for i in ids], [payload(i) for i in ids])
    tier.writer.flush()


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the tier that a planted link points at."""
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_bytes(b"not the tier's")
    return path


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path, victim,
                                                                     monkeypatch):
    """Links at the writer's names (its fixed `<key>.tmp` of before, the random name it draws
    now, fixed here, and the block's own name): the victim keeps its bytes; a link at the
    temporary name fails that one write (a miss later), a link at the block's name is replaced."""
    import secrets

    folder = tmp_path / "tier"
    tier = DiskTier(folder, SIZE, 10 * SIZE)
    monkeypatch.setattr(secrets, "token_hex", lambda n: "ab" * n)
    (folder / f"{key(1).hex()}.tmp").symlink_to(victim)
    (folder / f".{key(1).hex()[:16]}.{'ab' * 8}.tmp").symlink_to(victim)
    block_file(folder, 2).symlink_to(victim)
    stored(tier, [1])
    assert victim.read_bytes() == b"not the tier's"
    assert tier.writer.errors == 1 and not tier.fetch(key(1))
    monkeypatch.undo()
    stored(tier, [2])  # renamed over the link at its name, not written through it
    assert victim.read_bytes() == b"not the tier's"
    assert not block_file(folder, 2).is_symlink()
    assert tier.fetch(key(2)) and tier.take(key(2)) == payload(2)
    tier.close()


def test_a_link_planted_at_a_block_name_is_not_read(tmp_path):
    """A whole, valid block file moved out of the tier and linked back in: not followed."""
    folder = tmp_path / "tier"
    tier = DiskTier(folder, SIZE, 10 * SIZE)
    stored(tier, [1])
    outside = tmp_path / "moved.kv"
    block_file(folder, 1).rename(outside)
    block_file(folder, 1).symlink_to(outside)
    assert not tier.fetch(key(1))
    assert tier.stats.corrupt == 1 and key(1) not in tier
    tier.close()


def test_a_fifo_planted_as_a_block_file_is_a_miss_without_blocking(tmp_path):
    folder = tmp_path / "tier"
    tier = DiskTier(folder, SIZE, 10 * SIZE)
    stored(tier, [1, 2])
    fifo = block_file(folder, 1)
    fifo.unlink()
    os.mkfifo(fifo)
    result: list[bool] = []
    reader = threading.Thread(target=lambda: result.append(tier.fetch(key(1))), daemon=True)
    reader.start()
    reader.join(GUARD_S)
    try:
        assert not reader.is_alive(), "the read blocked on a FIFO"
        assert result == [False] and tier.stats.corrupt == 1
        assert tier.fetch(key(2))  # the tier goes on
    finally:
        if reader.is_alive():  # release a reader blocked in open(): a writer end, then EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(GUARD_S)
        tier.close()


def plant_bad_entries(folder: Path, good: Path) -> list[str]:
    """A dangling link, garbage, a folder, a truncated header, a FIFO and a link to a good
    block file under block names, and a name that is no key: what a restart must skip."""
    block_file(folder, 11).symlink_to(folder / "nowhere")
    block_file(folder, 12).write_bytes(os.urandom(SIZE + 200))
    block_file(folder, 13).mkdir()
    block_file(folder, 14).write_bytes(good.read_bytes()[:20])
    os.mkfifo(block_file(folder, 15))
    block_file(folder, 16).symlink_to(good)
    (folder / "not-hex.kv").write_bytes(good.read_bytes())
    return [block_file(folder, i).name for i in range(11, 17)] + ["not-hex.kv"]


@pytest.mark.parametrize("keep", [True, False], ids=["keep-files", "fresh"])
def test_a_restart_on_a_folder_with_bad_entries_starts_and_skips_them(tmp_path, keep):
    folder = tmp_path / "tier"
    tier = DiskTier(folder, SIZE, 10 * SIZE)
    stored(tier, [1])
    tier.close()
    bad = plant_bad_entries(folder, block_file(folder, 1))
    again = DiskTier(folder, SIZE, 10 * SIZE, keep_files=keep)
    assert again.stats.corrupt == len(bad)
    assert list(again.index) == ([key(1)] if keep else [])
    assert again.fetch(key(1)) == keep
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([block_file(folder, 13).name] + [block_file(folder, 1).name] * keep)
    stored(again, [11, 13])  # a name the restart freed is written; a folder's is a failed write
    assert again.fetch(key(11)) and not again.fetch(key(13))
    again.close()


def test_a_block_whose_header_names_another_model_or_layout_is_a_miss(tmp_path):
    from kserve_paged_engine.core.kv_tier.files import BlockFormat

    folder = tmp_path / "tier"
    mine = BlockFormat(bytes(range(32)), "bfloat16", "auto", 16, 2, 2, 16)
    others = (BlockFormat(bytes(32), "bfloat16", "auto", 16, 2, 2, 16),  # another model
              BlockFormat(bytes(range(32)), "float32", "auto", 16, 2, 2, 16),
              BlockFormat(bytes(range(32)), "bfloat16", "auto", 16, 2, 4, 8))
    for other in others:
        tier = DiskTier(folder, SIZE, 10 * SIZE, fmt=mine)
        stored(tier, [1, 2])
        tier.close()
        again = DiskTier(folder, SIZE, 10 * SIZE, fmt=other)
        assert key(1) in again and not again.fetch(key(1))
        assert again.stats.corrupt == 1 and key(1) not in again
        again.close()
    same = DiskTier(folder, SIZE, 10 * SIZE, fmt=mine)
    assert same.fetch(key(2)) and same.take(key(2)) == payload(2)
    same.close()


def test_a_tier_folder_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tier").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symbolic link is not followed"):
        DiskTier(tmp_path / "tier", SIZE, 10 * SIZE)
