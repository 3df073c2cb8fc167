"""Count the host reads of device values (and pageable host-to-device list copies) that a
piece of the project's code makes: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool()`,
`int()`, `float()` of a tensor, and `torch.tensor(data, device=...)` from a Python list. On
CUDA each read is a sync with the stream; each list copy a pageable upload.

    with host_reads() as reads:
        ...
    reads.sites  # Counter {"engine/kserve_paged_engine/sample/sampler.py:117 tolist": 1, ...}

Only calls made from the project's own files (engine/, kernels/) are counted, so torch's and
Triton's internals (the interpreter reads its tensors on the host) are not. The counter
patches torch while it is open; the same code runs on CPU, where nothing syncs, so the count
is what the code would do on CUDA.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COUNTED = tuple(str(ROOT / d) + "/" for d in ("engine", "kernels"))
METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")


@dataclass
class HostReads:
    sites: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _site(depth: int) -> str | None:
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    if not name.startswith(COUNTED):
        return None
    return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno}"


@contextmanager
def host_reads() -> Iterator[HostReads]:
    reads = HostReads()
    saved = {m: getattr(torch.Tensor, m) for m in METHODS}
    real_tensor = torch.tensor

    def wrap(name: str, real):
        def counted(self, *a, **kw):
            site = _site(2)
            if site is not None:
                reads.sites[f"{site} {name.strip('_')}"] += 1
            return real(self, *a, **kw)
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
        yield reads
    finally:
        for m, real in saved.items():
            setattr(torch.Tensor, m, real)
        torch.tensor = real_tensor
