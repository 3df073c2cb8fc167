"""The second KV tier's bytes on disk: one file per block, in a folder treated as untrusted.

A file is a header and the payload (the block's K/V bytes of every layer). The header names
what the bytes were computed for: the tier identity (a digest of the model's content, dtype,
KV dtype, layout, block size and hash algorithm: engine/kserve_paged_engine/core/kv_tier/identity.py), the dtype,
KV dtype and layout in plain fields, then the block's key, the payload length and a CRC-32 of
the payload. A read that finds anything else (another model's or layout's header, another key,
a short file, a wrong checksum) is a miss (None), never a wrong answer.

The folder may be shared with other writers, or have things planted in it, so every file is
reached through the folder's descriptor (opened once, without following a link) and never by
following a link: a read opens with O_NOFOLLOW | O_NONBLOCK (a FIFO cannot block the engine
thread) and reads only a regular file of exactly the expected size; a write goes to a fresh
random temporary name created with O_EXCL | O_NOFOLLOW, then is renamed into place (a rename
replaces a link planted at the block's name, never writes through it).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kserve_paged_engine")

MAGIC = b"KVTIER02"
# magic, identity digest, dtype, KV dtype, block size, layers, KV heads, head size
FORMAT = struct.Struct("<8s32s16s16sIIII")
ENTRY = struct.Struct("<32sQI")  # block key, payload bytes, CRC-32 of the payload
HEADER_BYTES = FORMAT.size + ENTRY.size
BLOCK_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
FILE_MODE = 0o600  # K/V bytes reveal the prompts they were computed from
FOLDER_MODE = 0o700
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_CREATE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What a block file's bytes were computed for (its header's first part)."""

    identity: bytes = bytes(32)  # SHA-256 of the tier identity string
    dtype: str = ""
    kv_dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0

    def pack(self) -> bytes:
        return FORMAT.pack(MAGIC, self.identity, self.dtype.encode()[:16],
                           self.kv_dtype.encode()[:16], self.block_size, self.num_layers,
                           self.num_kv_heads, self.head_dim)


def block_name(key: bytes) -> str:
    return f"{key.hex()}{BLOCK_SUFFIX}"


def open_folder(folder: Path) -> int:
    """The tier folder's descriptor (created if missing); ValueError if it is a link or not a
    folder: what it points to is not this tier's to write."""
    try:
        folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                       | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"the KV tier folder {folder} cannot be opened as a folder "
                         f"({exc.strerror or exc}; a symbolic link is not followed)") from None


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            return None  # shorter than fstat said: changed while read
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def read_block(dir_fd: int, key: bytes, size: int, fmt: bytes) -> bytes | None:
    """The payload if the file is a regular file of the expected size whose header is `fmt`
    (a `BlockFormat.pack()`) and this key, and whose checksum holds; else None."""
    try:
        fd = os.open(block_name(key), _READ, dir_fd=dir_fd)
    except OSError:  # missing, a link (ELOOP), a folder, no permission
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER_BYTES + size:
            return None
        head = _read_exact(fd, HEADER_BYTES)
        payload = _read_exact(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if head is None or payload is None or head[:FORMAT.size] != fmt:
        return None
    file_key, length, crc = ENTRY.unpack_from(head, FORMAT.size)
    if file_key != key or length != size or zlib.crc32(payload) != crc:
        return None
    return payload


def write_block(dir_fd: int, key: bytes, payload: memoryview | bytes, fmt: bytes) -> None:
    """Header then payload, under a fresh random temporary name renamed into place."""
    tmp = f".{key.hex()[:16]}.{secrets.token_hex(8)}{TMP_SUFFIX}"
    fd = os.open(tmp, _CREATE, FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(fmt + ENTRY.pack(key, len(payload), zlib.crc32(payload)))
            f.write(payload)
        os.replace(tmp, block_name(key), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        remove_entry(dir_fd, tmp)
        raise


def remove_entry(dir_fd: int, name: str) -> bool:
    """Unlink `name` in the folder (a link itself, never what it points to); False if it is
    gone already or cannot go (a folder planted under a block's name is left, and logged)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("KV tier: cannot remove %s: %s", name, exc.strerror or exc)
        return False
