"""What a disk tier's blocks were computed for, bound to content rather than to names.

A block's bytes depend on the model's weights and config, the dtype, the KV cache dtype and
layout, and (through the key) the hash algorithm and root. A path says none of that for sure: a
new checkpoint written to the same folder keeps its path. So the tier's identity starts from a
digest of the model's files (every regular file at the top of the model folder, or the .gguf
file given, with the .json files beside it), by name, size and content; its SHA-256 names the
tier's folder under `root_dir` and opens every block file's header (files.BlockFormat), which a
read checks. An adapter is keyed the same way, by its content (engine/kserve_paged_engine/lora/adapter.py), not
by a process-local id.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kserve_paged_engine.core.kv_tier.files import BlockFormat

logger = logging.getLogger("kserve_paged_engine")

HASH_THREADS = 4  # files hashed at once (hashlib lets go of the GIL on large buffers)


def _model_files(model_path: str) -> list[Path]:
    """The files a model's KV can depend on: a folder's top-level regular files (config,
    weights, tokenizer; links followed, as the loader follows them), or a .gguf file and the
    .json files beside it. Hidden files and subfolders are not read by the loader."""
    path = Path(model_path).expanduser()
    if path.is_file():
        return [path, *sorted(p for p in path.parent.glob("*.json") if p.is_file())]
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def _file_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def model_digest(model_path: str, load_format: str = "auto", seed: int = 0) -> str:
    """SHA-256 (hex) of the model's files by name, size and content; `load_format` "dummy"
    draws the weights from `seed`, so that joins the digest instead of weight files."""
    t0 = time.perf_counter()
    files = _model_files(model_path)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(_file_digest, files))
    h = hashlib.sha256(f"{load_format}|{seed if load_format == 'dummy' else ''}".encode())
    for path, digest in zip(files, digests):
        h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode() + digest)
    logger.info("KV tier: model content digest of %d files in %.2f s", len(files),
                time.perf_counter() - t0)
    return h.hexdigest()


def tier_identity(model: str, dtype: str, kv_dtype: str, quantization: str | None,
                  block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  hash_algo: str, hash_root: bytes, tp_size: int = 1
                  ) -> tuple[str, BlockFormat]:
    """(identity string, block file format): the identity names the tier's folder, and its
    digest opens every block file's header with the dtype and layout in plain fields.
    `tp_size` > 1: a block file holds each rank's own heads in rank order
    (engine/kserve_paged_engine/worker/tp_tier.py), so the size joins the identity and a store
    written at one tensor-parallel size is never read at another (TP = 1's identity is
    unchanged)."""
    parts: tuple[object, ...] = (model, dtype, kv_dtype, quantization, num_layers, num_kv_heads,
                                 head_dim, block_size, hash_algo, hash_root.hex())
    if tp_size > 1:
        parts += (f"tp{tp_size}",)
    identity = "|".join(map(str, parts))
    fmt = BlockFormat(hashlib.sha256(identity.encode()).digest(), dtype, kv_dtype, block_size,
                      num_layers, num_kv_heads, head_dim)
    return identity, fmt
