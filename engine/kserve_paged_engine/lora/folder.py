"""An adapter's folder, opened once and read through its descriptor.

Why: a runtime adapter's folder is named by a client and lies under roots others may write to
(the server's --lora_roots). A path checked once and opened again later (the re-read after the
LRU evicted the adapter) may by then be a link to anywhere. So the folder is opened once, at
the adapter's first load: its real path is walked one component at a time, following no link
(a link there now was swapped in after the path was resolved, and is refused), and every file
is then opened relative to that descriptor, again following no link (safe_read.py). A folder
confined to roots must resolve under one of them, and before every read its current place
(``/proc/self/fd``) is checked again: a folder moved out of the roots, or deleted, is refused.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

# O_PATH: a handle to walk and open files from, needing no read permission on the folder (as
# a path lookup needs none); with O_NOFOLLOW | O_DIRECTORY a link is refused (ENOTDIR).
_DIR_FLAGS = (getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW
              | getattr(os, "O_CLOEXEC", 0))


def inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies under it (both normalized, no link resolved here)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def under_roots(real: str, roots: Sequence[str]) -> bool:
    """``real`` (a resolved path) lies under one of ``roots``, each resolved."""
    return any(inside(real, os.path.realpath(root)) for root in roots)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_without_links(path: str, real: str) -> int:
    """A descriptor on the folder ``real`` (``path`` resolved), reached from ``/`` without
    following any link; ValueError saying why not."""
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in real.split(os.sep):
            if not part:
                continue
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if _is_link(part, fd) or exc.errno == errno.ELOOP:
                    raise ValueError(f"{path} changed while it was opened: a symbolic link is "
                                     "in its path now, and none is followed") from None
                if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                    raise ValueError(f"{path} is not a folder") from None
                raise ValueError(f"{path} cannot be opened ({exc.strerror or exc})") from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class AdapterFolder:
    """One adapter folder, held open from its first load until the adapter is removed.

    ``roots``: the folders it must stay under (None: not confined, an operator's adapter)."""

    def __init__(self, path: str, roots: Sequence[str] | None = None) -> None:
        self.roots = tuple(roots) if roots is not None else None
        self.path = os.path.realpath(path)
        if self.roots is not None and not under_roots(self.path, self.roots):
            raise ValueError(f"{path} resolves outside the adapter roots "
                             f"({', '.join(self.roots) or 'none'})")
        self.fd = _open_without_links(path, self.path)

    def check(self) -> None:
        """ValueError unless the folder still exists and, if confined, still lies under its
        roots (where it is now, not where it was)."""
        st = os.fstat(self.fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_nlink == 0:
            raise ValueError(f"the adapter folder {self.path} was deleted")
        if self.roots is None:
            return
        try:
            now = os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            raise ValueError(f"cannot tell where the adapter folder {self.path} is now") from None
        if not under_roots(now, self.roots):
            raise ValueError(f"the adapter folder {self.path} is now at {now}, outside the "
                             f"adapter roots ({', '.join(self.roots) or 'none'})")

    def has(self, name: str) -> bool:
        """A file or link called ``name`` is in the folder (nothing is followed)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            os.close(fd)
