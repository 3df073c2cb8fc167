"""Count the host reads of device values (and pageable host-to-device list copies) that a
piece of the project's code makes. On CUDA each read is a sync with the stream; each list copy
a pageable upload.

    with host_reads() as reads:
        ...
    reads.sites  # Counter {"engine/kserve_paged_engine/sample/sampler.py:117 tolist": 1, ...}

Two kinds of read are seen:
- made in Python: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool()`, `int()`, `float()`
  of a tensor, and `torch.tensor(data, device=...)` from a Python list (torch.Tensor's methods
  are patched while the counter is open);
- made inside torch's C++ by an op whose result's size or value must come back to the host
  before it returns (`torch.bincount`, `nonzero`, boolean-mask indexing, `repeat_interleave`
  with tensor repeats and no `output_size`, `unique`, `masked_select`, `torch.equal`, an
  `.item()` taken in C++, ...): a `TorchDispatchMode` sees every aten op and names the ones in
  `SYNCING_OPS` / `_conditional_read`. On CPU these run without a sync, so only the op tells.

Only calls made from the project's own files (engine/, kernels/) are counted: for a Python read,
the caller's frame; for an op, the innermost frame outside torch's package. So torch's and
Triton's internals (the interpreter reads its tensors on the host) are not. The same code runs
on CPU, where nothing syncs, so the count is what the code would do on CUDA. The dispatch mode
is per thread: code run on another thread while the counter is open is not seen.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
COUNTED = tuple(str(ROOT / d) + "/" for d in ("engine", "kernels"))
METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")
_TORCH_DIRS = tuple({str(Path(torch.__file__).parent) + "/",  # as frames name it
                     str(Path(torch.__file__).resolve().parent) + "/"})
_aten = torch.ops.aten
# Ops that read a device value back on CUDA whatever their arguments: their output's size (or
# a Python value) depends on the data.
SYNCING_OPS: dict[Any, str] = {
    _aten._local_scalar_dense: "item",
    _aten.is_nonzero: "bool",
    _aten.nonzero: "nonzero",
    _aten.bincount: "bincount",
    _aten.masked_select: "masked_select",
    _aten._unique: "unique",
    _aten._unique2: "unique",
    _aten.unique_dim: "unique",
    _aten.unique_consecutive: "unique_consecutive",
    _aten.unique_dim_consecutive: "unique_consecutive",
    _aten.equal: "equal",
    _aten.allclose: "allclose",
}
_INDEXING = (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_)


@dataclass
class HostReads:
    sites: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _project_site(frame: FrameType | None) -> str | None:
    """`file:line` of `frame` when it is in a counted file, else None."""
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if not name.startswith(COUNTED):
        return None
    return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno}"


def _site(depth: int) -> str | None:
    return _project_site(sys._getframe(depth))


def _op_site() -> str | None:
    """The innermost frame outside torch's package and this file: the code that called the op."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIRS)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return _project_site(frame)


def _conditional_read(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The ops that read the host only for some arguments."""
    packet = func.overloadpacket
    if packet in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ()):
            return "index[bool mask]"  # a mask is indices only after a nonzero
    elif func is _aten.repeat_interleave.Tensor:
        if kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
            return "repeat_interleave(tensor repeats)"  # the output's length is their sum
    elif packet is _aten.histc:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if lo == hi:
            return "histc(min=max)"  # the range is read from the data
    return None


class _OpReads(TorchDispatchMode):
    """Counts the host-reading aten ops that project code calls."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.muted = 0  # inside a patched Python read: counted there already

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.muted:
            name = SYNCING_OPS.get(func.overloadpacket) or _conditional_read(func, args, kwargs)
            if name is not None:
                site = _op_site()
                if site is not None:
                    self.reads.sites[f"{site} {name}"] += 1
        return func(*args, **kwargs)


@contextmanager
def host_reads() -> Iterator[HostReads]:
    reads = HostReads()
    ops = _OpReads(reads)
    saved = {m: getattr(torch.Tensor, m) for m in METHODS}
    real_tensor = torch.tensor

    def wrap(name: str, real):
        def counted(self, *a, **kw):
            site = _site(2)
            if site is not None:
                reads.sites[f"{site} {name.strip('_')}"] += 1
            ops.muted += 1
            try:
                return real(self, *a, **kw)
            finally:
                ops.muted -= 1
        return counted

    def tensor(data, *a, **kw):
        if kw.get("device") is not None and not isinstance(data, torch.Tensor):
            site = _site(2)
            if site is not None:
                reads.sites[f"{site} tensor(list, device=)"] += 1
        return real_tensor(data, *a, **kw)

    try:
        for m in METHODS:
            setattr(torch.Tensor, m, wrap(m, saved[m]))
        torch.tensor = tensor
        with ops:
            yield reads
    finally:
        for m, real in saved.items():
            setattr(torch.Tensor, m, real)
        torch.tensor = real_tensor
