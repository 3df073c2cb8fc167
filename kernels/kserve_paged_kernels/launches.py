"""Count the kernel launches a piece of GPU-path code makes: Triton launches by kernel, ATen
ops by op.

Why: a decode step at small batch costs launches, not bytes; the target is about a dozen per
decoder layer (issue 32), and this is how a test holds it there without a GPU. Two hooks while
`counting()` is active:
- every `kernel[grid](...)` launch of a Triton kernel, compiled or interpreted (a wrapper around
  `KernelInterface.__getitem__`, which both kinds inherit);
- every ATen op that reaches the dispatcher (a `TorchDispatchMode`), except views and bare
  allocations, which launch nothing on CUDA. Each other op stands for one kernel on CUDA: that
  is exact for elementwise ops, copies, fills and matrix products by cuBLAS, a floor for the
  few that launch several. Ops that return no tensor (host-side questions such as
  `promote_types`) and ops run inside a Triton launch (the interpreter's own copies of its
  arguments) are not counted. `.item()`-style reads (`_local_scalar_dense`) are a
  device-to-host copy and a sync, counted here and in `syncs`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCount", "count_launches", "counting", "variant"]

_aten = torch.ops.aten
# Not views, and yet no kernel: allocations and metadata-only reshapes.
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten._unsafe_view.default,
    _aten.resize_.default,
}
_SYNC = {_aten._local_scalar_dense.default}


@dataclass
class LaunchCount:
    """Launches seen: Triton kernels by name, ATen ops by name, and host syncs."""

    triton: Counter[str] = field(default_factory=Counter)
    aten: Counter[str] = field(default_factory=Counter)
    syncs: int = 0
    # Triton compile keys seen (`variant`): what a warm-up must have compiled before serving.
    variants: set[tuple] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())

    def table(self) -> str:
        """One line per kernel or op, most frequent first, then the total."""
        rows = [(f"triton {k}", n) for k, n in self.triton.items()]
        rows += [(f"aten {k}", n) for k, n in self.aten.items()]
        rows.sort(key=lambda r: (-r[1], r[0]))
        width = max((len(r[0]) for r in rows), default=5)
        lines = [f"{name:<{width}}  {n}" for name, n in rows]
        lines.append(f"{'total':<{width}}  {self.total}  (host syncs: {self.syncs})")
        return "\n".join(lines)


class _AtenCounter(TorchDispatchMode):
    def __init__(self, count: LaunchCount, inside_triton: list[int]) -> None:
        super().__init__()
        self.count = count
        self.inside_triton = inside_triton

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.inside_triton[0] or func.is_view or func in _NO_KERNEL:
            return out
        if func in _SYNC:
            self.count.syncs += 1
        elif not isinstance(out, torch.Tensor | list | tuple):
            return out  # host-side questions (promote_types, sizes): no kernel
        self.count.aten[str(func.overloadpacket.__name__)] += 1
        return out


@contextmanager
def counting() -> Iterator[LaunchCount]:
    """Count launches made inside the block (this thread's ATen ops, any Triton launch; only
    the ATen ops where Triton is not installed)."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        KernelInterface = None  # noqa: N806 - the class, when Triton is there
    count = LaunchCount()
    inside = [0]
    if KernelInterface is None:
        with _AtenCounter(count, inside):
            yield count
        return
    original = KernelInterface.__getitem__

    def launcher(self: Any, grid: Any) -> Callable[..., Any]:
        launch = original(self, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            count.triton[getattr(getattr(self, "fn", None), "__name__", repr(self))] += 1
            count.variants.add(variant(self, args, kwargs))
            inside[0] += 1
            try:
                return launch(*args, **kwargs)
            finally:
                inside[0] -= 1

        return run

    KernelInterface.__getitem__ = launcher
    try:
        with _AtenCounter(count, inside):
            yield count
    finally:
        KernelInterface.__getitem__ = original


def variant(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """A Triton launch's compile key, as Triton specializes: the kernel, each tensor's dtype
    and 16-byte alignment, each integer's `== 1` and `% 16 == 0` (not for `do_not_specialize`
    arguments), and the keyword arguments (constexprs, `num_warps`) exactly."""
    names = list(getattr(kernel, "arg_names", None) or [])
    params = getattr(kernel, "params", None)
    if params:
        fixed = {p.name for p in params if p.do_not_specialize}
    else:  # the interpreter's function keeps its decorator's keywords
        raw = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
        fixed = {names[i] if isinstance(i, int) else i for i in raw}
    key: list[Any] = [getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))]
    for name, a in zip(names, args):
        if name in fixed:
            continue
        if isinstance(a, torch.Tensor):
            key.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            key.append((name, a))
        elif isinstance(a, int):
            key.append((name, a == 1, a % 16 == 0))
        elif isinstance(a, float):
            key.append((name, "float"))
        else:
            key.append((name, repr(a)))
    key += sorted((k, repr(v)) for k, v in kwargs.items())
    return tuple(key)


def count_launches(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, LaunchCount]:
    """`fn(*args, **kwargs)`'s result and the launches it made."""
    with counting() as count:
        result = fn(*args, **kwargs)
    return result, count
