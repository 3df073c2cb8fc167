"""Where a runtime-loaded LoRA adapter may come from: ``--lora_roots``.

``POST /load_lora_adapter`` names a folder for the server to read, so a client must not be able
to name any folder: the path has to lie under one of the configured roots (default KServe's
model-storage mount ``/mnt/models`` and ``/mnt/lora``, where KServe mounts adapters). The check
is on the fully resolved path: ``..`` and symbolic links are resolved first, so a link inside a
root that points out of it is refused, and a link that stays inside is fine. The engine then
opens the resolved folder once, following no link on the way, holds it open and reads every
file through it (engine/kserve_paged_engine/lora/folder.py), checking at each read, the re-read
after an eviction included, that the folder still lies under the same roots: a link swapped in
after this check is never followed.

Whether runtime loads are on at all: ``--enable_lora_runtime_updates``, or vLLM's switch
``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``1`` or ``true``), which a vLLM user already sets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kserve_paged_engine.lora.folder import inside as _inside

DEFAULT_LORA_ROOTS = ("/mnt/models", "/mnt/lora")
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class AdapterPathError(ValueError):
    """The path is not one the server may read (answered 400)."""


def runtime_updates_from_env() -> bool:
    """vLLM's reading of ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``: on for ``1`` or ``true``."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


def confine(path: object, roots: Sequence[str]) -> str:
    """The real path of adapter folder ``path`` if it lies under one of ``roots`` (also
    resolved), else AdapterPathError saying why. Nothing under the path is read."""
    if not isinstance(path, str) or not path:
        raise AdapterPathError("lora_path must be a non-empty string")
    if len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise AdapterPathError("lora_path is not a valid path")
    if not os.path.isabs(path):
        raise AdapterPathError(f"lora_path must be absolute (got {path[:200]!r})")
    real_roots = [os.path.realpath(r) for r in roots]
    allowed = ", ".join(roots) or "none: --lora_roots is empty"
    # The path as written must already be under a root (no '..' out and back in) ...
    written = os.path.normpath(path)
    if not any(_inside(written, os.path.normpath(r)) or _inside(written, rr)
               for r, rr in zip(roots, real_roots, strict=True)):
        raise AdapterPathError(f"lora_path {path[:200]!r} is outside the adapter roots "
                               f"({allowed}; --lora_roots)")
    # ... and so must be what it resolves to, links included.
    real = os.path.realpath(path)
    if not any(_inside(real, rr) for rr in real_roots):
        raise AdapterPathError(f"lora_path {path[:200]!r} resolves outside the adapter roots "
                               f"({allowed}; --lora_roots): symbolic links out of a root are "
                               "not followed")
    if not os.path.isdir(real):
        raise AdapterPathError(f"lora_path {path[:200]!r} is not a folder")
    return real
