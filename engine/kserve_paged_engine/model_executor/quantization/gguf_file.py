"""A GGUF file's tensor index and raw bytes, read once without parsing its metadata values.

Why not `gguf.GGUFReader`: it builds a numpy view for every metadata item, which for a
tokenizer's 49k tokens and merges costs seconds before the first tensor is read (4.7 s for
SmolLM2's 94 MiB file on a shared 2-core machine). This walks the metadata only to skip it,
keeps the two values the loader needs (`general.architecture`, `general.alignment`), and maps
the tensor data read-only: each tensor is a numpy view of its bytes, as the file stores them.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; the metadata
(key, type, value); the tensor infos (name, dims innermost first, type, offset); padding to
the alignment; the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_WANTED = ("general.architecture", "general.alignment")


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One tensor: its name, block type, shape `[rows, cols]` (outermost first, as PyTorch
    reads it) and its bytes `[rows, bytes per row]` (a view of the mapped file)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    architecture: str
    tensors: dict[str, RawTensor]


class _Cursor:
    """Reads little-endian values from the mapped header, moving forward."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize("<" + fmt)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.take("Q"))
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def skip_string(self) -> None:
        n = int(self.take("Q"))  # read first: `pos += take()` would add to the old pos
        self.pos += n

    def value(self, kind: int, keep: bool) -> object:
        """One metadata value; only a kept one is decoded (a skipped array costs a loop over
        its strings, or nothing for fixed-size items)."""
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == _ARRAY:
            item, count = int(self.take("I")), int(self.take("Q"))
            if item in _SCALARS:
                skip = count * struct.calcsize("<" + _SCALARS[item])
                self.pos += skip
            else:
                for _ in range(count):
                    self.value(item, False)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"GGUF metadata value of unknown type {kind}")
        return self.take(_SCALARS[kind])


def read_index(path: Path) -> GGUFIndex:
    """The file's architecture and tensors (views of the read-only mapped file); ValueError
    for a file that is not GGUF v2/v3."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = int(cur.take("I"))
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (this reader takes 2 and 3)")
    n_tensors, n_kv = int(cur.take("Q")), int(cur.take("Q"))
    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        kind = int(cur.take("I"))
        value = cur.value(kind, key in _WANTED)
        if key in _WANTED:
            meta[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [int(cur.take("Q")) for _ in range(int(cur.take("I")))]
        infos.append((name, GGMLQuantizationType(int(cur.take("I"))), dims, int(cur.take("Q"))))
    align = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, qtype, dims, offset in infos:
        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        row_bytes = dims[0] // block_weights * block_bytes
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        at = start + offset
        data = buf[at:at + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = RawTensor(name, qtype, shape, data)
    return GGUFIndex(str(meta.get("general.architecture", "")), tensors)
