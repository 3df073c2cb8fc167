"""Building, caching and loading the native library.

The library is built with the system C compiler (plain C, no PyTorch headers, so a build takes
seconds) and cached under `settings.cache_dir() / "native"`. The file name carries a hash of
everything that decides what the build contains: the sources and headers, the flags, the
compiler's identity and the CPU's instruction set. `-march=native` makes the code depend on the
machine, so a cache shared by machines with different CPUs (an AVX-512 one and an AVX2 one)
must not hand one machine's build to the other, where it would die on an illegal instruction.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels import settings
from kernels.cpu_native import abi

logger = logging.getLogger("kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = tuple(CSRC / name for name in (
    "library.c", "paged_rows.c", "paged_key_tile.c", "paged_prefix.c", "paged_dispatch.c",
    "cpu_ops.c", "gemm.c", "decoder_stack.c", "lora_sgmv.c"))
HEADERS = tuple(CSRC / name for name in ("kp_native.h", "paged_attention.h", "simd_exp.h"))
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fvisibility=hidden", "-Wall",
         "-Wextra", "-shared", "-fPIC")

_lib: ctypes.CDLL | None = None
_tried = False


def find_compiler() -> str | None:
    """`$CC`, else gcc, else cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _first_line(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else ""


def cpu_features() -> str:
    """The CPU's instruction-set flags (the `flags` line of /proc/cpuinfo on Linux), which
    decide what `-march=native` compiles in; elsewhere, what the compiler resolves it to."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    compiler = find_compiler()
    if compiler is None:
        return platform.machine()
    try:
        proc = subprocess.run([compiler, "-march=native", "-Q", "--help=target"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return platform.machine()
    return proc.stdout if proc.returncode == 0 else platform.machine()


def build_key(compiler: str) -> str:
    """Hash of the sources, the flags, the compiler's identity and the CPU's features."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(FLAGS).encode() + b"\0")
    digest.update(_first_line([compiler, "--version"]).encode() + b"\0")
    digest.update(cpu_features().encode())
    return digest.hexdigest()[:16]


def build() -> Path:
    """The library's path in the cache, compiling it first when it is not there."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    target = settings.cache_dir() / "native" / f"kp_native-{build_key(compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        if proc.stderr.strip():
            logger.warning("native CPU kernels built with warnings: %s", proc.stderr[-2000:])
        os.replace(out, target)  # atomic: a half-written library is never loaded
    return target


def load() -> ctypes.CDLL | None:
    """The library, built on first use; None (the reason logged once) when it is turned off,
    cannot be built, or was built for another ABI version."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not settings.native_enabled():
        logger.info("native CPU kernels disabled by %s", settings.NATIVE.name)
        return None
    try:
        lib = ctypes.CDLL(str(build()))
        version_fn = lib.kp_abi_version
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None
    version_fn.restype, version_fn.argtypes = ctypes.c_int, []
    version = version_fn()
    if version != abi.ABI_VERSION:
        logger.warning("native CPU kernels rejected: the library has ABI version %d, this "
                       "Python code expects %d; using the PyTorch path", version,
                       abi.ABI_VERSION)
        return None
    try:
        abi.declare(lib)
    except AttributeError as exc:
        logger.warning("native CPU kernels rejected (%s); using the PyTorch path", exc)
        return None
    _lib = lib
    logger.info("native CPU kernels loaded")
    return _lib


def loaded() -> ctypes.CDLL:
    """The library for a caller that has checked it can run here (`usable()`,
    `gemm_available()`); RuntimeError when it is not loaded."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not loaded (check usable() first)")
    return lib


_thread_state = threading.local()  # OpenMP's thread count is a per-thread setting


def sync_threads(lib: ctypes.CDLL) -> None:
    """Give the library's OpenMP regions torch's thread count (a ctypes call only on change)."""
    n = torch.get_num_threads()
    if getattr(_thread_state, "threads", 0) != n:
        lib.kp_set_threads(n)
        _thread_state.threads = n
