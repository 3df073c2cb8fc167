"""The second KV tier's bytes on disk: one file per block, checksummed, written by a thread.

A file is a header (magic, the block's key, payload length, CRC-32 of the payload) and the
payload, the block's K/V bytes of every layer. A read that finds a short file, another key, a
wrong length or a wrong checksum is a miss (None): a torn write, a disk error or a file edited
by hand never becomes a wrong answer. Writes go through a temporary name and `os.replace`, so a
reader never sees half a file from this process. The writer thread lets the engine step go on
while the disk works; a block queued but not yet written is served from memory (`pending`).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate

logger = logging.getLogger("kserve_paged_engine")

DEFAULT_WRITE_BPS = 500e6  # the disk's write rate until the writer has measured one
MAGIC = b"KVTIER01"
HEADER = struct.Struct("<8s32sQI")  # magic, block key, payload bytes, CRC-32


def block_path(folder: Path, key: bytes) -> Path:
    return folder / f"{key.hex()}.kv"


def write_block(path: Path, key: bytes, payload: memoryview | bytes) -> None:
    """Header then payload, under a temporary name renamed into place."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload)))
        f.write(payload)
    os.replace(tmp, path)


def read_block(path: Path, key: bytes, size: int) -> bytes | None:
    """The payload if the file is whole and its checksum holds, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            payload = f.read(size + 1)
    except OSError:
        return None
    if len(head) != HEADER.size:
        return None
    magic, file_key, length, crc = HEADER.unpack(head)
    if magic != MAGIC or file_key != key or length != size or len(payload) != size:
        return None
    if zlib.crc32(payload) != crc:
        return None
    return payload


class BlockWriter:
    """Writes and deletes block files in order on one thread; `pending` holds the payloads
    queued but not yet on disk (a read in the meantime takes them from there)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: dict[bytes, memoryview | bytes] = {}
        self.errors = 0
        self.bytes_written = 0  # by the thread: files on disk (bench/kv_tier.py's disk rate)
        self.write_s = 0.0
        self.write_rate = MeasuredRate(DEFAULT_WRITE_BPS)  # per file, what a swap would cost
        self.last_error: float | None = None  # time.monotonic() of the last failed write
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes, memoryview | bytes | None] | None] = (
            queue.Queue())
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def write(self, key: bytes, payload: memoryview | bytes) -> None:
        with self._lock:
            self.pending[key] = payload
        self._queue.put(("w", key, payload))

    def delete(self, key: bytes) -> None:
        with self._lock:
            self.pending.pop(key, None)
        self._queue.put(("d", key, None))

    def peek(self, key: bytes) -> memoryview | bytes | None:
        with self._lock:
            return self.pending.get(key)

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, key, payload = item
                path = block_path(self.folder, key)
                if op == "w":
                    self._write(path, key, payload)
                else:
                    path.unlink(missing_ok=True)
            finally:
                self._queue.task_done()

    def _write(self, path: Path, key: bytes, payload: memoryview | bytes | None) -> None:
        assert payload is not None
        t0 = time.perf_counter()
        try:
            write_block(path, key, payload)
            took = time.perf_counter() - t0
            self.bytes_written += len(payload)
            self.write_s += took
            self.write_rate.observe(len(payload), took)
        except OSError as exc:  # a full or failing disk: the block is a miss later
            self.errors += 1
            self.last_error = time.monotonic()
            logger.warning("KV tier: writing %s failed: %s", path, exc)
        with self._lock:
            if self.pending.get(key) is payload:
                del self.pending[key]
