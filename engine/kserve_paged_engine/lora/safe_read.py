"""Reading an adapter's files without trusting them.

An adapter folder can come from a client (``load_lora_adapter``), so its files are read the way
untrusted input is: opened without following a symbolic link in the last component (relative to
the folder's descriptor, ``dir_fd``, when the folder was opened once: folder.py), checked to
be regular files of a bounded size (from ``fstat``, before a byte is read), and the weights
parsed only as safetensors, whose header is checked (dtypes, shapes, offsets inside the file)
before the tensors are made. A pickle (``adapter_model.bin``) is never opened.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json
MAX_HEADER_BYTES = 16 << 20  # a safetensors header (JSON); safetensors' own cap is 100 MB
# Element sizes of the dtypes an adapter may hold (PEFT saves the model's float dtype).
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _open_regular(path: Path, max_bytes: int, what: str,
                  dir_fd: int | None = None) -> tuple[int, int]:
    """An fd on ``path`` (no link followed in its last component; with ``dir_fd``, the file
    of ``path``'s name in that folder) and its size; ValueError when it is a link, not a
    regular file, or larger than ``max_bytes``."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore it).
        fd = os.open(path if dir_fd is None else path.name,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=dir_fd)
    except FileNotFoundError:
        raise ValueError(f"no {what}") from None
    except OSError as exc:  # ELOOP: a symbolic link; EACCES; ...
        raise ValueError(f"{what} cannot be opened ({exc.strerror or exc}; symbolic links "
                         "are not followed)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{what} has {st.st_size} bytes, more than any adapter this "
                             f"server accepts can have ({max_bytes})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            raise ValueError("the file is shorter than its size (changed while read)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_config(folder: Path, dir_fd: int | None = None) -> dict[str, Any]:
    """adapter_config.json of ``folder`` (read through ``dir_fd``, the folder's, if given)."""
    fd, size = _open_regular(folder / "adapter_config.json", MAX_CONFIG_BYTES,
                             "adapter_config.json", dir_fd)
    try:
        text = _read_exact(fd, size)
    finally:
        os.close(fd)
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"adapter_config.json is not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError("adapter_config.json must hold a JSON object")
    return cfg


def _check_header(header: Any, data_bytes: int) -> None:
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"safetensors entry {name[:100]!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name[:100]!r} has dtype {dtype!r} (accepted: "
                             f"{', '.join(DTYPE_BYTES)})")
        if (not isinstance(shape, list) or len(shape) > 2
                or not all(isinstance(d, int) and 0 <= d < 1 << 31 for d in shape)):
            raise ValueError(f"tensor {name[:100]!r} has an invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ValueError(f"tensor {name[:100]!r} has data offsets outside the file")
        count = 1
        for d in shape:
            count *= d
        if count * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise ValueError(f"tensor {name[:100]!r}: its shape does not match its bytes")


def read_safetensors(path: Path, max_bytes: int, dir_fd: int | None = None) -> dict[str, Any]:
    """The tensors of safetensors file ``path`` (at most ``max_bytes``; read through
    ``dir_fd``, its folder's, if given), header checked first."""
    from safetensors.torch import load

    fd, size = _open_regular(path, max_bytes, path.name, dir_fd)
    try:
        if size < 8:
            raise ValueError(f"{path.name} is not a safetensors file (too short)")
        head = _read_exact(fd, 8)
        header_len = int.from_bytes(head, "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name} is not a safetensors file (header length "
                             f"{header_len} of a {size}-byte file)")
        raw_header = _read_exact(fd, header_len)
        try:
            header = json.loads(raw_header)
        except (ValueError, RecursionError):
            raise ValueError(f"{path.name} is not a safetensors file (bad header)") from None
        _check_header(header, size - 8 - header_len)
        data = head + raw_header + _read_exact(fd, size - 8 - header_len)
    finally:
        os.close(fd)
    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
        raise ValueError(f"{path.name} is not a valid safetensors file ({exc})") from None
