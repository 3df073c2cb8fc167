"""The second KV tier: prefix blocks evicted from the pool, kept on local disk by their key.

On a CPU server the pool already lives in host memory, so the tier below it is a folder (an
emptyDir or a PVC): one checksummed file per block (engine/kserve_paged_engine/core/kv_tier/files.py), written by
a thread (writer.py). The key is the prefix cache's own block hash
(engine/kserve_paged_engine/core/block_hash.py), which already covers the tokens of the whole chain, the LoRA
adapter's content and the cache salt; the folder is named by what else the bytes depend on
(the model's content, dtype, KV dtype, layout, block size, hash algorithm: identity.py), and
every file's header names it too, so a tier written by another model, checkpoint or dtype is
never read. The folder is untrusted: it is opened once without following a link, and an entry
that is not a block file of this tier (a link, a folder, a FIFO, a file of the wrong size or
name) is skipped at start-up and a miss later, never a crash. The tier keeps at most
`capacity_bytes`; which block leaves first is the eviction policy's (LRU or ARC,
engine/kserve_paged_engine/core/kv_tier/policy.py). What the policy decides (which evicted blocks to keep,
which blocks a lookup may take) lives here and in kv_cache_manager.py; the byte copies out of
and into the KV tensors are the model runner's (engine/kserve_paged_engine/worker/kv_tier_copy.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kserve_paged_engine.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kserve_paged_engine.core.kv_tier.files import (
    BLOCK_SUFFIX,
    HEADER_BYTES,
    TMP_SUFFIX,
    BlockFormat,
    block_name,
    open_folder,
    read_block,
    remove_entry,
)
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from kserve_paged_engine.core.kv_tier.policy import make_policy
from kserve_paged_engine.core.kv_tier.writer import BlockWriter

logger = logging.getLogger("kserve_paged_engine")

TIER_MEDIUM = "DISK"  # the medium KV events name for blocks in this tier
FREE_SPACE_SHARE = 0.9  # without a capacity: this share of the folder's free disk
STAGED_BYTES = 64 << 20  # blocks read by lookups kept in memory between steps
DEFAULT_READ_BPS = 1e9  # the disk's read rate (and check) until a read has measured one


@dataclass(slots=True)
class TierStats:
    """Counts since start (what the tier metrics report): blocks asked for and found, bytes
    and seconds each way, blocks dropped for room and files found corrupt."""

    queries: int = 0
    hits: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    evictions: int = 0
    corrupt: int = 0


def tier_folder(root_dir: str, identity: str) -> Path:
    """The folder of one model/dtype/layout under a tier's root."""
    return Path(root_dir) / hashlib.sha256(identity.encode()).hexdigest()[:16]


def _key_of(name: str) -> bytes | None:
    """The 32-byte key a block file's name spells, or None."""
    try:
        key = bytes.fromhex(name[:-len(BLOCK_SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == 32 else None


class DiskTier:
    """The block index (LRU order), the files behind it and the blocks read for this step."""

    def __init__(self, folder: Path, block_bytes: int, capacity_bytes: int | None = None,
                 block_size: int = 16, keep_files: bool = True, policy: str = "lru",
                 fmt: BlockFormat | None = None) -> None:
        """`keep_files` False: forget any earlier process's files (their keys cannot match:
        without PYTHONHASHSEED the block hashes are random per process). `fmt`: what this
        tier's blocks were computed for, the header every file must start with."""
        self.dir_fd = open_folder(folder)
        try:
            self._build(folder, block_bytes, capacity_bytes, block_size, keep_files, policy,
                        fmt or BlockFormat())
        except BaseException:
            os.close(self.dir_fd)
            raise

    def _build(self, folder: Path, block_bytes: int, capacity_bytes: int | None,
               block_size: int, keep_files: bool, policy: str, fmt: BlockFormat) -> None:
        if capacity_bytes is None:
            capacity_bytes = int(shutil.disk_usage(folder).free * FREE_SPACE_SHARE)
        self.capacity_blocks = capacity_bytes // block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"the KV tier at {folder} holds no block: {capacity_bytes} bytes "
                             f"for blocks of {block_bytes} bytes")
        self.folder = folder
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.format = fmt.pack()
        self.index = make_policy(policy, self.capacity_blocks)  # the keys kept, in policy order
        # Blocks read and checked by lookups, most recent last: a request that waits at the
        # head of the queue looks its prefix up every step and must not read it every time.
        self.staged: OrderedDict[bytes, memoryview | bytes] = OrderedDict()
        self._staged_bytes = 0
        self.events: list[KVCacheEvent] = []
        self.stats = TierStats()
        self.read_rate = MeasuredRate(DEFAULT_READ_BPS)  # file reads and checks, bytes/s
        # Keys of swapped-out requests' blocks (engine/kserve_paged_engine/core/kv_tier/swap.py): kept and evicted like
        # any block, but no prefix of anyone else's, so never announced in KV events.
        self.private: set[bytes] = set()
        self._scan(keep_files)
        self.writer = BlockWriter(self.dir_fd, self.format)

    def _scan(self, keep: bool) -> None:
        """Index the block files an earlier process left (oldest first), or delete them.
        Left temporary files go; an entry under a block's name that cannot be one of this
        tier's (a link, a FIFO, a file of another size, a bad name) is removed and counted
        corrupt, a folder only counted: nothing found here stops the start."""
        found: list[tuple[float, bytes]] = []
        bad: list[str] = []
        with os.scandir(self.dir_fd) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(TMP_SUFFIX):
                    remove_entry(self.dir_fd, name)
                    continue
                if not name.endswith(BLOCK_SUFFIX):
                    continue  # not the tier's: left alone
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since listed (another writer)
                key = _key_of(name)
                if (key is None or not stat.S_ISREG(st.st_mode)
                        or st.st_size != HEADER_BYTES + self.block_bytes):
                    bad.append(name)
                elif keep:
                    found.append((st.st_mtime, key))
                else:
                    remove_entry(self.dir_fd, name)
        for name in bad:
            remove_entry(self.dir_fd, name)
        if bad:
            self.stats.corrupt += len(bad)
            logger.warning("KV tier: %d entries in %s are not block files of this tier (a "
                           "link, a folder, a FIFO, a file of another size or name), skipped; "
                           "e.g. %s", len(bad), self.folder, ", ".join(sorted(bad)[:3]))
        found.sort()
        for _, key in found[:self.capacity_blocks]:
            self.index.insert(key)
        for _, key in found[self.capacity_blocks:]:
            remove_entry(self.dir_fd, block_name(key))

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def usage(self) -> float:
        return len(self.index) / self.capacity_blocks

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    @property
    def write_rate(self) -> MeasuredRate:
        """The writer's per-file disk rate (what a swap-out would cost)."""
        return self.writer.write_rate

    @property
    def last_error(self) -> float | None:
        return self.writer.last_error

    def count(self, queries: int, keys: Sequence[bytes]) -> None:
        """An admitted request's lookup: blocks asked of the tier, and those it had."""
        self.stats.queries += queries
        self.stats.hits += len(keys)

    def store(self, keys: list[bytes], payloads: list[memoryview | bytes]) -> None:
        """Keep these evicted blocks (their bytes copied out of the pool already); a key kept
        before only becomes the most recent."""
        t0 = time.perf_counter()
        for key, payload in zip(keys, payloads):
            if key in self.index:
                self.index.touch(key)
                continue
            for old in self.index.insert(key):
                self._evict(old)
            self.writer.write(key, payload)
            self._stored(key)
            self.stats.bytes_written += len(payload)
        self.stats.write_s += time.perf_counter() - t0

    def _stored(self, key: bytes) -> None:
        """One BlockStored per run of stores (a removal in between starts another)."""
        if key in self.private:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored):
            last.block_hashes.append(key)
        else:
            self.events.append(BlockStored([key], None, [], self.block_size, None, TIER_MEDIUM))

    def touch(self, key: bytes) -> None:
        """A kept block evicted from the pool again: as good as a hit for the policy."""
        self.index.touch(key)

    def _evict(self, key: bytes) -> None:
        self.writer.delete(key)
        self.stats.evictions += 1
        self._removed(key)

    def _removed(self, key: bytes) -> None:
        if key in self.private:
            self.private.discard(key)
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == TIER_MEDIUM:
            last.block_hashes.append(key)
        else:
            self.events.append(BlockRemoved([key], TIER_MEDIUM))

    def discard(self, key: bytes) -> None:
        """Let a block go that no one will ask for again (a swap read back, or abandoned)."""
        self._unstage(key)
        if key in self.index:
            self.index.remove(key)
            self.writer.delete(key)
            self._removed(key)
        self.private.discard(key)

    def fetch(self, key: bytes) -> bool:
        """Read and check a block for a lookup of this step; False (and the block forgotten)
        if it is not kept or its file is missing, short or corrupt."""
        if key not in self.index:
            self._unstage(key)
            return False
        if key in self.staged:
            self.staged.move_to_end(key)
            return True
        t0 = time.perf_counter()
        payload = self.writer.peek(key)
        if payload is None:
            payload = read_block(self.dir_fd, key, self.block_bytes, self.format)
            if payload is not None:
                self.read_rate.observe(len(payload), time.perf_counter() - t0)
        self.stats.read_s += time.perf_counter() - t0
        if payload is None:
            self.stats.corrupt += 1
            logger.warning("KV tier: block %s is missing, corrupt or of another model or "
                           "layout: a miss", key.hex()[:16])
            self.index.remove(key)
            self.writer.delete(key)
            self._removed(key)
            return False
        self.index.touch(key)
        self.staged[key] = payload
        self._staged_bytes += len(payload)
        return True

    def _unstage(self, key: bytes) -> None:
        payload = self.staged.pop(key, None)
        if payload is not None:
            self._staged_bytes -= len(payload)

    def take(self, key: bytes) -> memoryview | bytes:
        """A fetched block's bytes, for the copy into the pool (counted as read); still staged
        after, so two restores of one key in a step both find it."""
        payload = self.staged[key]
        self.stats.bytes_read += len(payload)
        return payload

    def end_step(self) -> None:
        """Keep at most STAGED_BYTES of read blocks, the least recently looked up leaving."""
        while self._staged_bytes > STAGED_BYTES and self.staged:
            self._unstage(next(iter(self.staged)))

    def stat_dict(self) -> dict[str, int | float]:
        """The engine stats of the tier (kserve_paged/metrics.py exposes them under vLLM's
        offloading connector's names)."""
        st = self.stats
        return {"kv_tier_block_queries": st.queries, "kv_tier_block_hits": st.hits,
                "kv_tier_read_bytes": st.bytes_read, "kv_tier_write_bytes": st.bytes_written,
                "kv_tier_read_time": st.read_s, "kv_tier_write_time": st.write_s,
                "kv_tier_evictions": st.evictions, "kv_tier_corrupt_blocks": st.corrupt,
                "kv_tier_blocks": len(self.index), "kv_tier_usage": self.usage}

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        os.close(self.dir_fd)
