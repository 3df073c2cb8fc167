"""A stand-in CUDA device for CPU-only tests: the engine's GPU path runs with every device-side
tensor a `StandinTensor` that says `cuda:0` and holds a CPU tensor with the real values, under
`StandinCuda`, a dispatch mode that raises where a GPU would fail or wait:

- `DeviceMixError`: a CPU tensor in an op on device tensors (as on CUDA, a 0-dim CPU tensor is
  taken in elementwise ops and CPU index tensors in indexing), a CPU generator drawing device
  values, a CPU tensor passed to a Triton kernel;
- `HostReadError`: a host read of a device value during an engine step (`.item()`, `bool()`,
  `.tolist()`, `.cpu()`, a blocking device-to-host copy, a stream or device synchronize, and the
  ops that read their input inside torch's C++ to size their output: `nonzero`, `bincount`,
  `unique`, boolean-mask indexing, ...), made by the project's code (engine/, kernels/)
  anywhere but the sync sites listed in `SYNC_SITES`;
- `CaptureError`: any host read, synchronize or blocking copy while a CUDA graph is captured
  (CUDA's "operation not permitted when stream is capturing").

Why real values rather than torch's FakeTensorMode: the intended sync points then need no
stand-in values, the engine's outputs can be compared with the CPU engine's, and a captured
graph can be replayed for real. Neither way gets past a CPU-only build's missing CUDA device
guard (slicing or copying a `cuda` tensor raises there), so a no-op guard is registered first
(tests/helpers/standin_cuda_api.py, with the torch.cuda stand-ins and the Triton seam).

    with StandinCuda() as mode:
        llm = LLM(model=..., device="cuda")
        with mode.steps():
            llm.generate(...)
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.standin_ops import (
    ALLOCATIONS,
    COPIES,
    INDEXING,
    METADATA_WRITES,
    PINNING,
    flat,
    pointwise,
    reads_inside,
    written_args,
)
from tests.helpers.standin_ops import arg as _arg

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(ROOT / d) + "/" for d in ("engine", "kernels"))
HERE = tuple(str(Path(__file__).with_name(n)) for n in ("standin_cuda.py",
                                                        "standin_cuda_api.py"))
DEVICE = torch.device("cuda", 0)
_aten = torch.ops.aten

# Where the project's code may read device values during a step, and why: `path::function`
# (the path relative to the repository), matched by the innermost project frame of a read.
SYNC_SITES = {
    "engine/kserve_paged_engine/model_executor/host_io.py::ReadBack.tokens":
        "the step's one sync: the sampled ids read back",
    "engine/kserve_paged_engine/worker/model_runner.py::_StepBuffers.wait_until_free":
        "waits for the last step's uploads, which its read-back already waited for",
    "engine/kserve_paged_engine/frontend/beam_search.py::BeamSearches._candidates":
        "a beam step chooses its forks on the host: one read of its best candidates",
    "engine/kserve_paged_engine/spec_decode/decoder.py::SpecDecoder.verify":
        "a speculative step's read-back: the target's tokens at the draft rows",
    "engine/kserve_paged_engine/spec_decode/rejection.py::rejection_sample":
        "rejection sampling tests each draft on the host",
    "engine/kserve_paged_engine/spec_decode/rejection.py::_draw":
        "rejection sampling draws its last token on the host",
}


class DeviceMixError(RuntimeError):
    """A CPU tensor where CUDA needs a device tensor."""


class HostReadError(RuntimeError):
    """A device value read on the host (a sync with the GPU) where none is allowed."""


class CaptureError(RuntimeError):
    """What CUDA refuses while a graph is being captured."""


class StandinTensor(torch.Tensor):
    """A tensor on the stand-in `cuda:0`; `inner` holds its values on CPU."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> StandinTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=DEVICE, requires_grad=False)
        t.inner = inner
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"StandinTensor({self.inner!r}, device='cuda:0')"

    def data_ptr(self) -> int:  # a device address: a number, never read on the host
        return self.inner.data_ptr()

    def tolist(self) -> Any:  # torch refuses tolist() of a subclass: a read, then the values
        if StandinCuda.active is None:
            raise RuntimeError("tolist() of a stand-in CUDA tensor outside StandinCuda")
        StandinCuda.active.read(".tolist()")
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(f"{func} on a stand-in CUDA tensor outside StandinCuda")


def _unwrap(tree: Any) -> Any:
    """An op's arguments with the CPU tensors behind the stand-in ones."""
    if isinstance(tree, StandinTensor):
        return tree.inner
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _unwrap(v) for k, v in tree.items()}
    return tree


def _wrap(tree: Any) -> Any:
    """An op's CPU results as stand-in device tensors."""
    if isinstance(tree, torch.Tensor) and not isinstance(tree, StandinTensor):
        return StandinTensor(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_wrap(x) for x in tree)
    return tree


def _wrap_view(tree: Any, base: Any) -> Any:
    """A view's wrappers: an inference tensor exactly when its base is one (made inside
    inference mode, a view of a normal tensor would be refused by autograd's view check)."""
    inference = isinstance(base, torch.Tensor) and base.is_inference()
    with torch.inference_mode(inference):
        return _wrap(tree)


def project_site(skip: int = 0, scope: tuple[str, ...] = PROJECT) -> str | None:
    """The innermost frame under `scope` (the project's engine/ and kernels/), as
    `path::function:line`; None when no frame is."""
    frame = sys._getframe(skip + 1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(scope) and not name.startswith(HERE):
            function = frame.f_code.co_qualname.split(".<locals>")[0]  # 3.11's comprehensions
            return f"{Path(name).relative_to(ROOT)}::{function}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class StandinCuda(TorchDispatchMode):
    """The mode (see the module docstring). `sync_sites`: where steps may read device values.

    It holds torch's FAKE mode slot, which is what makes torch skip CUDA's lazy init for a
    factory on `cuda` (torch's own FakeTensorMode relies on the same)."""

    active: StandinCuda | None = None  # the mode on (one at a time: it holds the FAKE slot)

    def __init__(self, sync_sites: dict[str, str] | None = None,
                 scope: tuple[str, ...] = PROJECT) -> None:
        super().__init__()
        self._mode_key = torch._C._TorchDispatchModeKey.FAKE
        self.sync_sites = dict(SYNC_SITES if sync_sites is None else sync_sites)
        self.scope = scope  # whose reads are judged (a test of the mode widens it)
        self.errors: list[str] = []  # every error raised, even where the engine caught it
        self.strict = 0  # > 0 inside `steps()`
        self.capture: list[tuple] | None = None  # the ops of a graph being captured
        self.in_kernel = 0  # > 0 inside a Triton launch or a replay: plain CPU work
        self.reads: Counter[str] = Counter()  # allowed reads by site
        self._pinned: set[int] = set()  # host storages allocated pinned (by address)
        self._api: Any = None

    def __enter__(self) -> StandinCuda:
        from tests.helpers.standin_cuda_api import CudaApi

        self._api = CudaApi(self)
        self._api.install()
        try:
            super().__enter__()
        except BaseException:
            self._api.remove()
            raise
        StandinCuda.active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            StandinCuda.active = None
            self._api.remove()

    @contextmanager
    def steps(self) -> Iterator[None]:
        """Inside: a host read outside `sync_sites` raises."""
        self.strict += 1
        try:
            yield
        finally:
            self.strict -= 1

    def read(self, what: str) -> None:
        """A host read or sync of the device is about to happen here."""
        site = project_site(1, self.scope)
        if self.capture is not None:
            self.fail(CaptureError(f"{what} at {site or 'a test'} while a CUDA graph is being "
                                   "captured: CUDA refuses it (operation not permitted when "
                                   "stream is capturing)"))
        if not self.strict or site is None:
            return
        if site.rpartition(":")[0] in self.sync_sites:
            self.reads[site] += 1
            return
        self.fail(HostReadError(f"{what} at {site} during an engine step: a host sync on "
                                "CUDA (allowed only at tests/helpers/standin_cuda.py's "
                                "SYNC_SITES)"))

    def site(self) -> str:
        """Where the project's code (or a test's, when nothing of the project is on the
        stack) made the current call."""
        return project_site(1, self.scope) or project_site(1, (str(ROOT),)) or "?"

    def fail(self, error: Exception) -> None:
        """Raise `error`, kept in `errors` (the engine may catch it and fail a request)."""
        self.errors.append(f"{type(error).__name__}: {error}")
        raise error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.in_kernel:
            return func(*args, **kwargs)
        if func.overloadpacket in PINNING:
            return self._pin(func, args)
        dev = [t for t in flat((args, kwargs)) if isinstance(t, StandinTensor)]
        target = kwargs.get("device")
        target = torch.device(target).type if target is not None else "cuda" if dev else None
        if not dev and target != "cuda":
            return self._host_op(func, args, kwargs)
        host = [t for t in flat((args, kwargs)) if isinstance(t, torch.Tensor)
                and not isinstance(t, StandinTensor) and t.device.type == "cpu"]
        self._check(func, args, kwargs, dev, host, target)
        if dev and reads_inside(func, args, kwargs):
            self.read(f"{func} (reads device values on the host)")
        uargs, ukwargs = _unwrap(args), _unwrap(kwargs)
        if target is not None and "device" in ukwargs:
            ukwargs["device"] = torch.device("cpu")
        ukwargs.pop("pin_memory", None)
        out = func(*uargs, **ukwargs)
        if self.capture is not None and func not in ALLOCATIONS:
            self.capture.append(("aten", func, uargs, ukwargs, out))
        written = written_args(func)
        if any(written):
            outs = [_arg(func, args, kwargs, n) if n else _wrap(o) for n, o
                    in zip(written, out if isinstance(out, (list, tuple)) else (out,))]
            return outs[0] if len(outs) == 1 else tuple(outs)
        if target != "cuda":
            return out
        return _wrap_view(out, args[0]) if func.is_view else _wrap(out)

    def _host_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        pin = kwargs.get("pin_memory")
        if pin:
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        out = func(*args, **kwargs)
        if pin:
            self.pin(out)
        return out

    def pin(self, t: torch.Tensor) -> None:
        """Mark a host tensor's memory pinned (there is no pinned allocator without CUDA)."""
        self._pinned.add(t.untyped_storage().data_ptr())

    def _pin(self, func: Any, args: tuple) -> Any:
        t = args[0]
        if isinstance(t, StandinTensor):
            raise RuntimeError("cannot pin a CUDA tensor: only dense CPU tensors can be pinned")
        pinned = t.untyped_storage().data_ptr() in self._pinned
        if func.overloadpacket is _aten.is_pinned or pinned:
            return pinned if func.overloadpacket is _aten.is_pinned else t
        copy = t.clone()
        self.pin(copy)
        return copy

    def _check(self, func: Any, args: tuple, kwargs: dict, dev: list, host: list,
               target: str | None) -> None:
        if func in METADATA_WRITES:
            raise NotImplementedError(f"{func} on a stand-in CUDA tensor (not modelled)")
        if func in COPIES:
            self._check_copy(func, args, kwargs, target)
            return
        gen = kwargs.get("generator")
        if target == "cuda" and gen is not None and gen.device.type != "cuda":
            self.fail(DeviceMixError(f"{func}: Expected a 'cuda' device type for generator "
                                     f"but found '{gen.device.type}' (at {self.site()})"))
        if "device" in kwargs or not dev or not host:
            return  # a factory reads its inputs' shapes only
        if func in INDEXING:
            indices = {id(t) for t in flat(args[1:2])}
            if isinstance(args[0], StandinTensor) and all(id(t) in indices or t.dim() == 0
                                                          for t in host):
                return  # CPU index tensors into a device tensor: CUDA copies them over
        elif pointwise(func) and all(t.dim() == 0 for t in host):
            return  # a CPU scalar in an elementwise op: CUDA takes it as a number
        shapes = ", ".join(f"cpu {tuple(t.shape)}" for t in host)
        self.fail(DeviceMixError(f"{func}: Expected all tensors to be on the same device, "
                                 f"but found at least two devices, cuda:0 and cpu ({shapes}) "
                                 f"(at {self.site()})"))

    def _check_copy(self, func: Any, args: tuple, kwargs: dict, target: str | None) -> None:
        if func is _aten._to_copy.default:
            src, to_host = args[0], target == "cpu"
            non_blocking = kwargs.get("non_blocking", False)
        else:
            src, to_host = args[1], not isinstance(args[0], StandinTensor)
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        from_dev = isinstance(src, StandinTensor)
        if from_dev and to_host and not non_blocking:
            self.read(f"a blocking device-to-host copy ({func})")
        elif not from_dev and not to_host and not non_blocking and self.capture is not None:
            self.fail(CaptureError(f"a blocking host-to-device copy at {self.site()} while "
                                   "a CUDA graph is being captured: CUDA refuses it"))

