"""GGUF's 4-bit blocks read as (codes, scale, minimum) per group of 32 weights, so they can be
packed for the int4 kernel exactly as they are, instead of dequantized to float.

Each block type stores `w = q * scale + minimum` with 4-bit codes q:
- Q4_0: 32 weights, fp16 d; `w = d * (q - 8)`: scale d, minimum -8 d.
- Q4_1: 32 weights, fp16 d and m; `w = d * q + m`.
- Q4_K: 256 weights in eight sub-blocks of 32, fp16 d and dmin with 6-bit (sc, m) per
  sub-block; `w = d * sc * q - dmin * m`: scale d x sc, minimum -dmin x m.
The scales are returned as float32 (an fp16 times a 6-bit integer is exact in float32).
Two types are read as int8 (codes, scale) for the group-wise int8 kernel, exactly:
- Q8_0: 32 int8 codes and one fp16 d, `w = d * q`: groups of 32.
- Q6_K: 256 weights, fp16 d and an int8 scale per 16, 6-bit codes q split into 4 low bits
  (`ql`) and 2 high bits (`qh`), `w = d * sc * (q - 32)`: codes q - 32 (in [-32, 31]) in
  groups of 16 with scale d x sc (an fp16 times an int8, exact in float32).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

INT4_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q4_K)
GROUP = 32


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 `[blocks, 1]`."""
    return raw[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(raw, 0)
    return _nibbles(raw[:, 2:18]), d, -8.0 * d


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(raw[:, 4:20]), _f16(raw, 0), _f16(raw, 2)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit (sc, m) pairs, `[blocks, 8]` each."""
    p = packed.astype(np.uint8)
    sc = np.empty((p.shape[0], 8), np.uint8)
    m = np.empty_like(sc)
    sc[:, :4], m[:, :4] = p[:, 0:4] & 63, p[:, 4:8] & 63
    sc[:, 4:] = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    m[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), m.astype(np.float32)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, m = _k_scales(raw[:, 4:16])
    qs = raw[:, 16:144].reshape(-1, 4, 32)  # four chunks of 64 weights
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)  # sub-blocks 2c, 2c+1
    return codes.reshape(-1, 8, GROUP), d * sc, -(dmin * m)


_READERS = {QT.Q4_0: (_q4_0, 18, 32), QT.Q4_1: (_q4_1, 20, 32), QT.Q4_K: (_q4_k, 144, 256)}


def int4_groups(data: np.ndarray, qtype: QT, rows: int, cols: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw bytes `[rows, bytes per row]` -> codes uint8 `[rows, cols]`, scale
    and minimum float32 `[rows, cols / 32]`."""
    if qtype not in _READERS:
        raise ValueError(f"{qtype.name} is not a 4-bit GGUF type read exactly "
                         f"(those are {', '.join(t.name for t in INT4_TYPES)})")
    read, block_bytes, block_weights = _READERS[qtype]
    if cols % block_weights:
        raise ValueError(f"a row of {cols} weights is not whole {qtype.name} blocks")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    codes, scale, minimum = read(raw)
    groups = cols // GROUP
    return (codes.reshape(rows, cols), scale.reshape(rows, groups),
            minimum.reshape(rows, groups))


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return raw[:, 2:].copy().view(np.int8), _f16(raw, 0)


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's 210 bytes: ql [128], qh [64], int8 scales [16], fp16 d. Each half of 128 weights
    takes 64 bytes of ql and 32 of qh: weight 32 j + l (j = 0..3) has the low nibble of
    ql[l + 32 (j % 2)] (j < 2: low nibble, else high) and bits 2 j, 2 j + 1 of qh[l]."""
    ql, qh = raw[:, :128].reshape(-1, 2, 64), raw[:, 128:192].reshape(-1, 2, 32)
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4,
                    ql[..., 32:] >> 4], axis=2)  # [blocks, 2, 4, 32]
    high = np.stack([(qh >> (2 * j)) & 3 for j in range(4)], axis=2)
    codes = (low | (high << 4)).astype(np.int16) - 32
    return codes.astype(np.int8).reshape(-1, 16, 16), _f16(raw, 208) * sc


# type -> (reader, bytes and weights of a block, weights per scale)
_INT8_READERS = {QT.Q8_0: (_q8_0, 34, 32, 32), QT.Q6_K: (_q6_k, 210, 256, 16)}
INT8_TYPES = tuple(_INT8_READERS)


def int8_groups(data: np.ndarray, rows: int, cols: int, qtype: QT = QT.Q8_0
                ) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 or Q6_K tensor's raw bytes -> codes int8 `[rows, cols]` and scale float32
    `[rows, cols / group]` (`w = q * scale`; group 32 for Q8_0, 16 for Q6_K)."""
    read, block_bytes, block_weights, group = _INT8_READERS[qtype]
    if cols % block_weights:
        raise ValueError(f"a row of {cols} weights is not whole {qtype.name} blocks")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    codes, scale = read(raw)
    return codes.reshape(rows, cols), scale.reshape(rows, cols // group)
