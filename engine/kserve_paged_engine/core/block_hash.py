"""Prefix-cache block keys, computed the way vLLM V1 computes them.

A router that recomputes vLLM's keys from a request's prompt tokens (llm-d's precise
prefix-cache scorer) and looks them up in the index it built from a pod's KV-cache events
finds this engine's blocks only if the engine keys its blocks the same way. So the key of a full
block is vLLM's: ``H((parent key, tuple of the block's token ids, extra keys or None))``, where
the first block's parent is a root key ``H(seed)`` and ``H`` is the ``--prefix_caching_hash_algo``:

- ``sha256``: SHA-256 of the pickled tuple (highest pickle protocol). vLLM's default; its bytes
  depend on Python's pickle, so only Python can recompute it.
- ``sha256_cbor``: SHA-256 of the tuple in canonical CBOR (RFC 8949), which any language can
  reproduce: the one a scorer outside the pod needs.

The seed is the ``PYTHONHASHSEED`` string, as in vLLM; unset, the root is 32 random bytes, so keys
differ between processes (no scorer can recompute them). Extra keys follow vLLM's order: the LoRA
adapter on every block of its requests, then the cache salt on the first block only (see
engine/kserve_paged_engine/core/kv_cache_manager.py). Events announce a key as vLLM does by default: its low 64 bits
(the last 8 bytes, big-endian) as an integer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kserve_paged_engine.config.engine import HASH_ALGOS

logger = logging.getLogger("kserve_paged_engine")

HASH_SEED_ENV = "PYTHONHASHSEED"  # vLLM's source of the root key


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    import cbor2  # only for this algorithm

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256_pickle,
                                                "sha256_cbor": sha256_cbor}


class BlockHasher:
    """Keys of one engine's blocks: the algorithm and the root key, fixed at start-up."""

    __slots__ = ("algo", "seed", "root", "_fn")

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        """`seed` None: PYTHONHASHSEED's value now; when that is unset too, a random root."""
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS} "
                             f"(got {algo!r})")
        if seed is None:
            seed = os.environ.get(HASH_SEED_ENV)
        self.algo = algo
        self.seed = seed
        self._fn = _HASH_FNS[algo]
        if seed is None:
            if algo == "sha256_cbor":
                logger.warning("%s is not set: the prefix-cache block hashes are random per "
                               "process, so no router can recompute them from a prompt",
                               HASH_SEED_ENV)
            self.root = os.urandom(32)
        else:
            self.root = self._fn(seed)

    def __call__(self, parent: bytes | None, token_ids: Sequence[int],
                 extra: tuple[Any, ...] | None = None) -> bytes:
        """The key of one full block after `parent` (None: the first block). Token ids are
        Python ints, as every request holds them (a numpy integer would pickle differently)."""
        return self._fn((parent or self.root, tuple(token_ids), extra))


def external_block_hash(block_hash: bytes) -> int:
    """The 64-bit form events carry (vLLM's default): the key's low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")
