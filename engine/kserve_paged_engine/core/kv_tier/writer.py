"""The second KV tier's writer thread: block files written and deleted in order off the engine
thread (engine/kserve_paged_engine/core/kv_tier/files.py says how), so a step goes on while
the disk works; a block queued but not yet written is served from memory (`pending`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kserve_paged_engine.core.kv_tier import files
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate

logger = logging.getLogger("kserve_paged_engine")

DEFAULT_WRITE_BPS = 500e6  # the disk's write rate until the writer has measured one


class BlockWriter:
    """Writes and deletes block files in order on one thread; `pending` holds the payloads
    queued but not yet on disk (a read in the meantime takes them from there)."""

    def __init__(self, dir_fd: int, fmt: bytes) -> None:
        self.dir_fd = dir_fd
        self.fmt = fmt  # every file's header starts with it (files.BlockFormat.pack())
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
                if op == "w":
                    self._write(key, payload)
                else:
                    files.remove_entry(self.dir_fd, files.block_name(key))
            except Exception:  # noqa: BLE001 - the thread must outlive any one file
                logger.exception("KV tier: the writer failed on one file")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, payload: memoryview | bytes | None) -> None:
        assert payload is not None
        t0 = time.perf_counter()
        try:
            files.write_block(self.dir_fd, key, payload, self.fmt)
            took = time.perf_counter() - t0
            self.bytes_written += len(payload)
            self.write_s += took
            self.write_rate.observe(len(payload), took)
        except OSError as exc:  # a full or failing disk, a name taken: a miss later
            self.errors += 1
            self.last_error = time.monotonic()
            logger.warning("KV tier: writing block %s failed: %s", key.hex()[:16], exc)
        finally:
            with self._lock:
                if self.pending.get(key) is payload:
                    del self.pending[key]
