"""Run code with its device tensors as fake tensors on a stand-in device and its host reads
answered by stand-in values, so a CPU/device mix raises on a machine without a GPU.

    with fake_reads() as reads:
        probs = torch.rand(3, 8, device=reads.device)
        ...  # the code under test
    reads.seen  # [(device type, shape), ...] of every host read, in order

torch's FakeTensorMode: a tensor carries shape, dtype and device but no data, and an op that
mixes devices raises `FakeTensorDeviceMismatchError` as CUDA would (a 0-dim CPU tensor passes,
as it does on CUDA). The stand-in device is `meta`: a fake `cuda` tensor works for dispatched
ops, but torch's Python indexing (`t[i]`, `t[idx] = v`) takes a CUDA device guard that a
CPU-only build lacks, so it could not be indexed here; fake `meta` tensors index, and mix with
CPU tensors exactly as CUDA ones do. A host read of a fake tensor (`.tolist()`, `.item()`,
`float()`, `int()`, `bool()`, which FakeTensorMode refuses) returns zeros of its shape and is
recorded, or raises `ReadReached` when `stop=True` (to end the code under test at its read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


class ReadReached(Exception):
    """The code under test reached a host read (`fake_reads(stop=True)`)."""


@dataclass
class FakeReads:
    device: str
    stop: bool
    seen: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def answer(self, t: FakeTensor) -> Any:
        self.seen.append((t.device.type, tuple(t.shape)))
        if self.stop:
            raise ReadReached(t.device.type, tuple(t.shape))
        zero = False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0
        return _nested(tuple(t.shape), zero)


def _nested(shape: tuple[int, ...], zero: Any) -> Any:
    return zero if not shape else [_nested(shape[1:], zero) for _ in range(shape[0])]


@contextmanager
def fake_reads(device: str = "meta", stop: bool = False) -> Iterator[FakeReads]:
    reads = FakeReads(device, stop)
    with pytest.MonkeyPatch.context() as mp:
        for scalar, kind in (("tolist", None), ("item", None), ("__float__", float),
                             ("__int__", int), ("__index__", int), ("__bool__", bool)):
            def read(t: FakeTensor, kind=kind) -> Any:
                value = reads.answer(t)
                return value if kind is None else kind(value)
            mp.setattr(FakeTensor, scalar, read, raising=False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield reads
