"""Triton kernels made runnable in a test: compiled on CUDA, in Triton's interpreter elsewhere.

TRITON_INTERPRET must be set when `@triton.jit` functions are defined: Triton's own language
helpers (decorated when `triton` is first imported, which torch may do at any time) and a
kernel module's kernels; and when a backend is resolved on CPU. So `prepare_interpreter` (run
by tests/conftest.py before any test module is imported) imports Triton with it set and unsets
it at once; `TritonKernels.load` sets it again while a test module's kernels load and its
tests run, and `close` puts the variable and every replaced module back as they were: no
other test sees the variable, and modules imported before keep their compiled kernels.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

_MISSING = object()


def prepare_interpreter() -> None:
    """Import Triton (if it imports) with TRITON_INTERPRET set, when there is no CUDA; the
    variable is as it was afterwards."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton here: TritonKernels.load skips
        pass
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def _language_interpreted() -> bool:
    import triton.language as tl

    return type(tl.standard.zeros).__name__ == "InterpretedFunction"


class TritonKernels:
    def __init__(self) -> None:
        self.interpret = not torch.cuda.is_available()
        self._env: str | None = None
        self._saved: dict[str, object] = {}  # module name -> module before (or _MISSING)
        self._entered = False

    def load(self, *names: str) -> ModuleType:
        """The modules in order (a module's kernel dependencies first); returns the last.
        Skips the test when Triton cannot run here."""
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - missing or broken on this host
            pytest.skip(f"Triton cannot run here: {type(exc).__name__}: {exc}")
        if not self.interpret:
            return [importlib.import_module(n) for n in names][-1]
        if not _language_interpreted():
            pytest.fail("Triton was imported before tests/conftest.py could prepare its "
                        "interpreter (prepare_interpreter): its language helpers are compiled "
                        "functions, which the interpreter cannot call")
        if not self._entered:
            self._env = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            self._entered = True
        module = None
        for name in names:
            if name not in self._saved:
                self._saved[name] = sys.modules.pop(name, _MISSING)
                module = importlib.import_module(name)
            else:
                module = sys.modules[name]
        assert module is not None
        return module

    def close(self) -> None:
        if not self._entered:
            return
        for name, before in self._saved.items():
            parent, _, leaf = name.rpartition(".")
            package = sys.modules.get(parent)
            if before is _MISSING:
                sys.modules.pop(name, None)
                if package is not None and hasattr(package, leaf):
                    delattr(package, leaf)
            else:
                sys.modules[name] = before  # type: ignore[assignment]
                if package is not None:
                    setattr(package, leaf, before)
        if self._env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self._env
        self._saved.clear()
        self._entered = False
