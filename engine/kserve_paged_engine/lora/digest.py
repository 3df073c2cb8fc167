"""An adapter's content digest: what keys its prefix-cache and KV-tier blocks.

A process-local adapter id says nothing after a restart (the next process may give the same id
to another adapter) and nothing about the files (a folder rewritten under the same name), so
the blocks an adapter computes are keyed by what it is: its config and its tensors (names,
dtypes, shapes, bytes), as read (engine/kserve_paged_engine/lora/adapter.py). The same files give the same digest in any
process; any change to them gives another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch


def content_digest(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of the adapter's config (canonical JSON) and every tensor, by name."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
