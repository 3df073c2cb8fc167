"""Where a runtime-loaded LoRA adapter may come from: ``--lora_roots``.

``POST /load_lora_adapter`` names a folder for the server to read, so a client must not be able
to name any folder: the path has to lie under one of the configured roots (default KServe's
model-storage mount ``/mnt/models`` and ``/mnt/lora``, where KServe mounts adapters). The check
is on the fully resolved path: ``..`` and symbolic links are resolved first, so a link inside a
root that points out of it is refused, and a link that stays inside is fine. The engine then
reads the resolved path, never following a link in its last component (engine/kserve_paged_engine/lora/adapter.py),
so a link swapped in after this check is not followed either.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

DEFAULT_LORA_ROOTS = ("/mnt/models", "/mnt/lora")
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


class AdapterPathError(ValueError):
    """The path is not one the server may read (answered 400)."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


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
