"""Write the Triton API surface our code may use, as one Triton version has it, to JSON.

    PYTHONPATH=/path/to/unpacked/triton-3.6.0-wheel python scripts/triton_api_snapshot.py \\
        > tests/data/triton_api_3.6.0.json

Why: the project supports the oldest Triton of the GPU image (3.6) as well as the installed
one; `tests/kernels/test_triton_api.py` checks every `triton` / `tl` name and keyword our code
uses against this snapshot, and that the installed Triton has them too, so a name added after
3.6 fails on CPU, not on the GPU. The script imports Triton, so it records what the runtime
really exposes: every name of each container below (for classes also the attributes their
`__init__` sets), and the parameter names of each callable in `triton`, `triton.language` and
of `tl.tensor`'s methods.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from typing import Any

HOW = ("pip download --no-deps --only-binary=:all: --python-version 3.11 --platform "
       "manylinux_2_28_x86_64 triton==3.6.0; unzip the wheel into DIR; PYTHONPATH=DIR python "
       "scripts/triton_api_snapshot.py > tests/data/triton_api_3.6.0.json (the wheel's compiled "
       "part matches the running Python, so it imports)")
MODULES = ["triton", "triton.language", "triton.language.core", "triton.runtime",
           "triton.runtime.jit", "triton.runtime.interpreter", "triton.compiler",
           "triton.backends.compiler", "triton.testing"]
CLASSES = ["triton.language.tensor", "triton.language.dtype", "triton.language.pointer_type",
           "triton.language.block_type", "triton.language.constexpr",
           "triton.runtime.jit.KernelInterface", "triton.runtime.jit.JITFunction",
           "triton.runtime.interpreter.InterpreterBuilder",
           "triton.runtime.interpreter.InterpretedFunction",
           "triton.backends.compiler.GPUTarget", "triton.compiler.ASTSource"]
# Callables whose parameter names are recorded: every public callable of these containers.
PARAM_CONTAINERS = ["triton", "triton.language", "triton.language.tensor"]


def _resolve(dotted: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


def _instance_attrs(cls: type) -> set[str]:
    """Attributes a class's instances get in `__init__` (`self.dtype = ...`): not in dir()."""
    import ast
    import textwrap

    found: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (TypeError, OSError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.add(node.attr)
    return found


def _names(dotted: str) -> list[str]:
    obj = _resolve(dotted)
    extra = _instance_attrs(obj) if inspect.isclass(obj) else set()
    return sorted(set(dir(obj)) | extra)


def _params(obj: Any) -> list[str] | None:
    fn = getattr(obj, "fn", obj)  # a JITFunction's Python function
    try:
        return [p for p in inspect.signature(fn).parameters if p != "_semantic"]
    except (TypeError, ValueError):
        return None


def snapshot() -> dict[str, Any]:
    import triton

    names = {c: _names(c) for c in MODULES + CLASSES}
    params: dict[str, list[str]] = {}
    for container in PARAM_CONTAINERS:
        obj = _resolve(container)
        for name in dir(obj):
            if name.startswith("_"):
                continue
            value = getattr(obj, name, None)
            if callable(value) and not inspect.isclass(value):
                found = _params(value)
                if found is not None:
                    params[f"{container}.{name}"] = found
    return {"triton_version": triton.__version__, "how": HOW,
            "names": names, "params": params}


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
