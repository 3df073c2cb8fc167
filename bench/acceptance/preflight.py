"""The acceptance run's preflight: before any stage, show in well under a minute that Triton can
compile a kernel and launch it on the GPU, and stop the run with one line saying why when it
cannot (rather than every stage failing in its own way, minutes later).

Two steps. In the parent (which imports only the standard library): what Triton builds its
kernel launchers with, a C compiler (`$CC`, else gcc, else clang: Triton's own search) and the
interpreter's `Python.h`. Then a child: the versions (what a failure report needs first), the
GPU as torch sees it, and one kernel compiled into an empty Triton cache (so the compile is
real, not a cache hit) and launched, its result checked. The dry run launches the kernel in
Triton's interpreter on CPU and needs no compiler.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from acceptance.runner import ROOT, Part, Stage

SUPPORTED = ("torch", "triton", "transformers")  # held to pyproject's ranges
PACKAGES = (*SUPPORTED, "tokenizers", "numpy", "pytest")
BUDGET_S, DRY_BUDGET_S = 45, 180


def toolchain_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why Triton could not build its launchers here (one line), or None."""
    env = os.environ if env is None else env
    path = env.get("PATH", "")
    cc = env.get("CC")
    if cc:
        if not shlex.split(cc) or shutil.which(shlex.split(cc)[0], path=path) is None:
            return f"no C compiler: CC={cc!r} is not an executable on PATH (Triton builds " \
                   "its kernel launchers with it)"
    elif not any(shutil.which(name, path=path) for name in ("gcc", "clang")):
        return "no C compiler: CC is unset and neither gcc nor clang is on PATH (Triton " \
               "builds its kernel launchers with one)"
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # as Triton does (Debian)
    header = Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h"
    if not header.is_file():
        return f"no {header} (Triton's kernel launchers include it): install the headers " \
               f"of Python {sysconfig.get_python_version()} (python3-dev)"
    return None


def _judge(data: dict[str, Any]) -> str | None:
    return None if data.get("ok") else data.get("why", "not ok")


def stage() -> Stage:
    """The preflight as a stage of one part: the same runner, limit and JSON as the others."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--stage-preflight"]
    return Stage("preflight", "Triton compiles and launches one kernel on the GPU; the "
                 "versions", BUDGET_S, DRY_BUDGET_S,
                 lambda ctx, folder: [Part("preflight", cmd, parse_json=True, judge=_judge)])


def one_line(result: dict[str, Any]) -> str:
    """The preflight's outcome in one line."""
    part = result.get("parts", {}).get("preflight", {})
    data = part.get("data", {})
    if result["status"] == "pass":
        where = data.get("gpu", {}).get("name", "CPU (Triton interpreted)")
        return (f"preflight: ok: Triton {data['versions']['packages'].get('triton')} compiled "
                f"and launched a kernel on {where} ({result['seconds']} s)")
    if result["status"] == "timeout":
        return (f"preflight failed: no answer within {result['timeout_s']} s (importing torch, "
                "CUDA's start or the first compile hung)")
    if data.get("why"):
        return f"preflight failed: {data['why']}"
    stderr = [ln for ln in part.get("output_tail", "").splitlines() if ln.strip()]
    return (f"preflight failed: {result.get('why', 'no report')}"
            + (f"; output ends: {stderr[-1][:300]}" if stderr else ""))


def versions() -> dict[str, Any]:
    """What is installed, whether pyproject admits it, and whether kserve / gguf import (the
    image has neither; the stages must not need them)."""
    import importlib.util
    import platform
    from importlib import metadata

    import tomllib

    out: dict[str, Any] = {"python": platform.python_version(), "packages": {},
                           "supported": {}}
    for name in PACKAGES:
        try:
            out["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out["packages"][name] = None
    try:
        from packaging.requirements import Requirement
    except ImportError:
        out["supported"] = "not checked: no packaging"
    else:
        deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        ranges = {r.name: r.specifier for r in map(Requirement, deps)}
        for name in SUPPORTED:
            version = out["packages"][name]
            out["supported"][name] = bool(version) and ranges[name].contains(
                version, prereleases=True)
    out["importable"] = {}
    for name in ("kserve", "gguf"):
        try:
            out["importable"][name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or blocked package
            out["importable"][name] = False
    return out


def child() -> dict[str, Any]:
    """The child's report: versions, the GPU, and whether one kernel compiled, launched and
    wrote what it should (`ok`, else `why`)."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"versions": versions(), "ok": False}
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreted:  # an empty cache: the compile must happen, not be found
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="preflight-triton-")
    step = "importing torch"
    try:
        import torch

        step = "finding the GPU"
        out["cuda"] = torch.cuda.is_available()
        if not out["cuda"] and not interpreted:
            out["why"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                          "CUDA device")
            return out
        if out["cuda"]:
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                          "memory_gib": round(props.total_memory / 2**30, 1),
                          "sms": props.multi_processor_count, "cuda": torch.version.cuda}
        step = "compiling and launching one Triton kernel"
        from acceptance.preflight_kernel import add_one_kernel

        x = torch.zeros(1000, device="cuda" if out["cuda"] else "cpu")
        add_one_kernel[(4,)](x, x.numel(), BLOCK=256)
        if out["cuda"]:
            torch.cuda.synchronize()
        if not bool((x == 1).all()):
            raise RuntimeError("the kernel ran but its output is wrong")
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the report is the point
        first = (str(exc).strip().splitlines() or [""])[0]
        out["why"] = f"{step} failed: {type(exc).__name__}: {first[:400]}"
    finally:
        out["seconds"] = round(time.monotonic() - t0, 1)
    return out
