"""Run kernel calls in a child process whose Triton is interpreted (compiled, on the GPU, when
CUDA is present), so the test process never sets TRITON_INTERPRET.

Why a child: `@triton.jit` picks compiled or interpreted when a function is defined, and that
includes triton.language's own jit helpers (`tl.sum`, `tl.max`, ...), which are defined when
Triton is first imported; an interpreted kernel cannot call compiled helpers. A process that
sets the variable before importing Triton is the only clean way in either order of tests.

    results = run_calls([("kserve_paged_kernels.act_triton", "act_mul_triton", (x,), {"gelu": True})], tmp)

Each call's return value and its positional arguments after the call (for in-place kernels)
come back through `torch.save` files. Child: `python -m tests.kernels.interpreted IN OUT`.

The child also makes the interpreter compute what the GPU computes
(`kserve_paged_kernels.testing.faithful_interpreter`): bf16 casts rounded to nearest even, not truncated.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kserve_paged_kernels.testing import faithful_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
REPO = Path(__file__).resolve().parents[2]
Call = tuple[str, str, tuple, dict]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of an interpreted child: TRITON_INTERPRET=1 unless CUDA is present."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def run_calls(calls: list[Call], tmp_dir: Path, timeout: int = 300) -> list[tuple[Any, tuple]]:
    """`(result, args after the call)` of each `(module, function, args, kwargs)`, run in one
    child; skips the test when Triton is not installed."""
    if importlib.util.find_spec("triton") is None:  # not imported here: see the docstring
        pytest.skip("Triton is not installed")
    src, dst = tmp_dir / "calls.pt", tmp_dir / "results.pt"
    torch.save(calls, src)
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.interpreted", str(src), str(dst)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(dst, weights_only=False)


def poison_empty() -> None:
    """From now on in this child, float32 `torch.empty` is NaN-filled: a kernel that reads
    scratch memory it never wrote shows it (a call to put before the calls it guards)."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.dtype == torch.float32 else out
    torch.empty = empty


def _main(src: str, dst: str) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        faithful_interpreter()
    results = []
    for module, name, args, kwargs in torch.load(src, weights_only=False):
        result = getattr(importlib.import_module(module), name)(*args, **kwargs)
        results.append((result, args))
    torch.save(results, dst)


if __name__ == "__main__":
    _main(*sys.argv[1:])
