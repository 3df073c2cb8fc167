"""What the stand-in CUDA device (tests/helpers/standin_cuda.py) puts around torch while it is
on: the no-op CUDA device guard, `torch.cuda`'s streams, events, graphs and device queries, the
Triton launch seam, and `torch.tensor` / `torch.as_tensor` on `cuda`.

- Streams and events: one ordered stream (work runs when it is issued, so cross-stream order
  is not checked); `synchronize()` of a stream, an event or the device is a host read.
- Graphs: `torch.cuda.graph` records every device op and Triton launch of the capture (each
  op's real arguments and output), and `replay()` runs the recording again over the same
  tensors, writing into the captured outputs: host-side Python is not re-run, so a value the
  host decided at capture stays frozen, as on a GPU. Pools are not shared between graphs.
- Triton: every `kernel[grid](...)` checks that each tensor argument is on the device, then
  launches on the CPU tensors behind them (the interpreter; TRITON_INTERPRET=1 in the process).
- The device reports itself as an H200 (132 SMs) with 4 GiB free.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from tests.helpers.standin_cuda import (
    DEVICE,
    CaptureError,
    DeviceMixError,
    StandinTensor,
)
from tests.helpers.standin_ops import flat

if TYPE_CHECKING:
    from tests.helpers.standin_cuda import StandinCuda

GUARD_SOURCE = Path(__file__).with_name("standin_guard.cpp")
PROPERTIES = SimpleNamespace(name="stand-in CUDA device (H200)", multi_processor_count=132,
                             total_memory=141 << 30, major=9, minor=0)
FREE_BYTES = 4 << 30
_guard: ctypes.CDLL | None = None


class GuardUnavailable(RuntimeError):
    """The no-op CUDA guard cannot be built here (no C++ compiler, or it failed)."""


def load_guard() -> None:
    """Register the no-op CUDA device guard in this process (built once into the cache)."""
    global _guard
    if _guard is not None:
        return
    if torch.cuda.is_available():
        raise GuardUnavailable("a real CUDA device is present: test on it instead")
    from kserve_paged_kernels import settings

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise GuardUnavailable("no C++ compiler (g++ or c++) on PATH")
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(GUARD_SOURCE.read_bytes() + torch.__version__.encode()
                         + compiler.encode()).hexdigest()[:16]
    target = settings.cache_dir() / "standin" / f"standin_guard-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, "-std=c++17", "-O1", "-shared", "-fPIC",
                 f"-I{torch_dir / 'include'}", str(GUARD_SOURCE), f"-L{torch_dir / 'lib'}",
                 "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)],
                capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise GuardUnavailable(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
            os.replace(out, target)  # atomic: a half-written library is never loaded
    _guard = ctypes.CDLL(str(target))


class StandinEvent:
    """torch.cuda.Event: work is done when issued, so it is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.mode = CudaApi.active.mode

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.mode.read("an event's synchronize")

    def elapsed_time(self, end: StandinEvent) -> float:
        return 0.0


class StandinStream:
    """torch.cuda.Stream: every stream is the one stream."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.mode = CudaApi.active.mode
        self.device = DEVICE

    def synchronize(self) -> None:
        self.mode.read("a stream's synchronize")

    def wait_event(self, event: StandinEvent) -> None:
        return None

    def wait_stream(self, stream: StandinStream) -> None:
        return None

    def record_event(self, event: StandinEvent | None = None) -> StandinEvent:
        event = event or StandinEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True


class StandinGraph:
    """torch.cuda.CUDAGraph: the recording of its capture, replayed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.mode = CudaApi.active.mode
        self.ops: list[tuple] | None = None

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("replay of a graph that was never captured")
        replay(self.mode, self.ops)

    def reset(self) -> None:
        self.ops = None


def replay(mode: StandinCuda, ops: list[tuple]) -> None:
    """Run a capture's ops again on the same tensors (see the module docstring); in inference
    mode, as captured (a replay writes into inference tensors whatever mode it is called in)."""
    mode.in_kernel += 1
    try:
        with torch.inference_mode():
            _replay_ops(ops)
    finally:
        mode.in_kernel -= 1


def _replay_ops(ops: list[tuple]) -> None:
    for op in ops:
        if op[0] == "triton":
            _, launch, args, kwargs = op
            launch(*args, **kwargs)
            continue
        _, func, args, kwargs, out = op
        result = func(*args, **kwargs)
        for captured, new in zip(flat(out), flat(result)):
            # A view, an in-place or out= op wrote where the capture's output lies already
            # (`to` aliases only when it converts nothing: the storage tells).
            if (isinstance(captured, torch.Tensor) and new.untyped_storage().data_ptr()
                    != captured.untyped_storage().data_ptr()):
                captured.copy_(new)


@contextmanager
def _graph(cuda_graph: StandinGraph, pool: Any = None, stream: Any = None,
           capture_error_mode: str = "global") -> Iterator[StandinGraph]:
    mode = CudaApi.active.mode
    if mode.capture is not None:
        mode.fail(CaptureError("a capture inside a capture"))
    ops: list[tuple] = []
    mode.capture = ops
    try:
        yield cuda_graph
    finally:
        mode.capture = None
    cuda_graph.ops = ops


@contextmanager
def _stream(stream: Any) -> Iterator[Any]:
    yield stream


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tensor.record_stream: the one stream needs no record; CUDA refuses a CPU tensor."""
    if not isinstance(tensor, StandinTensor):
        CudaApi.active.mode.fail(DeviceMixError(
            f"record_stream of a {tensor.device.type} tensor (at {CudaApi.active.mode.site()}):"
            " only CUDA tensors record streams"))


def _kernel_arg(mode: StandinCuda, value: Any, kernel: str, where: str) -> Any:
    """A Triton argument as the launch on CPU takes it; a CPU tensor raises."""
    from triton.runtime.jit import TensorWrapper

    if isinstance(value, StandinTensor):
        return value.inner
    if isinstance(value, TensorWrapper):
        return TensorWrapper(_kernel_arg(mode, value.base, kernel, where), value.dtype)
    if isinstance(value, tuple):
        return tuple(_kernel_arg(mode, v, kernel, where) for v in value)
    if isinstance(value, torch.Tensor):
        mode.fail(DeviceMixError(
            f"a {value.device.type} tensor {tuple(value.shape)} as argument {where} of Triton "
            f"kernel {kernel} (at {mode.site()}): on CUDA Triton refuses it (Pointer argument "
            "cannot be accessed from Triton (cpu tensor?))"))
    return value


class CudaApi:
    """Installs and removes the stand-ins for one `StandinCuda`."""

    active: CudaApi  # the installed one (one mode at a time: it holds torch's FAKE slot)

    def __init__(self, mode: StandinCuda) -> None:
        self.mode = mode
        self._saved: list[tuple[Any, str, Any]] = []

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self) -> None:
        load_guard()
        CudaApi.active = self
        mode, default = self.mode, StandinStream()
        cuda = torch.cuda
        stand_ins: dict[str, Any] = {
            "is_available": lambda: True, "device_count": lambda: 1,
            "current_device": lambda: 0, "set_device": lambda device: None,
            "synchronize": lambda device=None: mode.read("torch.cuda.synchronize"),
            "Event": StandinEvent, "Stream": StandinStream, "stream": _stream,
            "current_stream": lambda device=None: default,
            "default_stream": lambda device=None: default,
            "CUDAGraph": StandinGraph, "graph": _graph, "graph_pool_handle": lambda: object(),
            "is_current_stream_capturing": lambda: mode.capture is not None,
            "get_device_properties": lambda device=None: PROPERTIES,
            "get_device_capability": lambda device=None: (PROPERTIES.major, PROPERTIES.minor),
            "get_device_name": lambda device=None: PROPERTIES.name,
            "mem_get_info": lambda device=None: (FREE_BYTES, PROPERTIES.total_memory),
            "empty_cache": lambda: None,
        }
        for name, value in stand_ins.items():
            self._set(cuda, name, value)
        self._set(torch.Tensor, "record_stream", _record_stream)
        self._set(torch, "tensor", self._on_device(torch.tensor))
        self._set(torch, "as_tensor", self._on_device(torch.as_tensor))
        try:
            from triton.runtime.jit import KernelInterface
        except ImportError:  # no Triton here: nothing launches
            return
        self._set(KernelInterface, "__getitem__", self._launcher(KernelInterface.__getitem__))

    def remove(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def _on_device(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """torch.tensor / as_tensor: built on the host, then copied to `cuda` (torch builds
        them below the dispatch modes, where no stand-in can be made); `pin_memory` marks."""
        mode = self.mode

        def make(data: Any, *args: Any, device: Any = None, pin_memory: bool = False,
                 **kwargs: Any) -> torch.Tensor:
            if device is not None and torch.device(device).type == "cuda":
                return real(data, *args, **kwargs).to(device)
            out = real(data, *args, device=device, **kwargs)
            if pin_memory:
                mode.pin(out)
            return out
        return make

    def _launcher(self, original: Callable[..., Any]) -> Callable[..., Any]:
        mode = self.mode

        def getitem(kernel: Any, grid: Any) -> Callable[..., Any]:
            launch = original(kernel, grid)
            name = getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))

            def run(*args: Any, **kwargs: Any) -> Any:
                if mode.in_kernel:
                    return launch(*args, **kwargs)
                args = tuple(_kernel_arg(mode, a, name, str(i)) for i, a in enumerate(args))
                kwargs = {k: _kernel_arg(mode, v, name, k) for k, v in kwargs.items()}
                mode.in_kernel += 1
                try:
                    result = launch(*args, **kwargs)
                finally:
                    mode.in_kernel -= 1
                if mode.capture is not None:
                    mode.capture.append(("triton", launch, args, kwargs))
                return result
            return run
        return getitem


def require_standin() -> None:
    """Skip the calling test where the stand-in device cannot stand in: a real GPU is here
    (test on it instead), or the no-op guard cannot be built (the reason is the skip's)."""
    import pytest

    if torch.cuda.is_available():
        pytest.skip("a real GPU is here")
    try:
        load_guard()
    except GuardUnavailable as exc:
        pytest.skip(str(exc))
