"""Building, caching and loading the native library, and what the loaded one is (its level,
the width of the weight panels it packs and multiplies).

The library is built with the system C compiler (plain C, no PyTorch headers, so a build takes
seconds) for one instruction-set level (`isa.py`: the highest this CPU runs, capped by
`KSERVE_PAGED_ISA`) and cached under `settings.cache_dir() / "native"`. The file name carries a
hash of everything that decides what the build contains: the sources and headers, the flags
(the level's `-march` among them) and the compiler's identity. A cache shared by machines with
different CPUs holds one library per level, and a machine only loads a level it can run.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kserve_paged_kernels import settings
from kserve_paged_kernels.cpu_native import abi, isa

logger = logging.getLogger("kserve_paged_kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = tuple(CSRC / name for name in (
    "library.c", "paged_rows.c", "paged_key_tile.c", "paged_prefix.c", "paged_dispatch.c",
    "paged_bf16.c", "paged_bf16_tile.c", "cpu_ops.c", "cpu_ops_bf16.c", "gemma_bf16.c",
    "gemm.c", "decoder_stack.c", "lora_sgmv.c", "quant_gemm.c", "gemm_bf16.c", "kv_q8.c", "paged_q8.c",
    "mxfp4_gemm.c"))
HEADERS = tuple(CSRC / name for name in ("kp_native.h", "kp_vec.h", "kp_bf16.h", "kp_kvq.h",
                                          "paged_attention.h", "paged_span.h", "kp_team.h"))
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wextra", "-shared",
         "-fPIC")  # plus the level's -march (isa.LEVELS)
ISA_TAG = b"kp-native-isa="  # library.c embeds this, then KP_ISA, then ";"

_lib: ctypes.CDLL | None = None
_level: isa.IsaLevel | None = None
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


def flags_for(level: isa.IsaLevel) -> tuple[str, ...]:
    """The compiler flags of a build for `level`."""
    return (*FLAGS, *level.march)


def build_key(compiler: str, level: isa.IsaLevel) -> str:
    """Hash of the sources, the flags (the level's among them) and the compiler's identity."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags_for(level)).encode() + b"\0")
    digest.update(_first_line([compiler, "--version"]).encode())
    return digest.hexdigest()[:16]


def _run_compiler(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def compile_library(compiler: str, level: isa.IsaLevel, out: Path,
                    extra_flags: tuple[str, ...] = ()) -> str:
    """Compile the library for `level` into `out` (any CPU may compile any level; only one
    that has the level's instructions may load it) and return the compiler's warnings ("" when
    none). RuntimeError with the compiler's words.

    Each source compiles to an object in a process of its own, as many at once as this process
    may use CPUs, and the objects are then linked: one compiler call over all sources compiles
    them one after the other, on one core, while a first build is what a cold start waits for.
    """
    flags = [*flags_for(level), *extra_flags]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count() or 1)
        workers = min(len(SOURCES), cpus)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            procs = list(pool.map(_run_compiler, [[compiler, *flags, "-c", str(src), "-o", obj]
                                                  for src, obj in zip(SOURCES, objects)]))
        if all(proc.returncode == 0 for proc in procs):
            procs.append(_run_compiler([compiler, *flags, *objects, "-o", str(out), "-lm"]))
    failed = [proc for proc in procs if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"{compiler} failed for {level.name}: "
                           f"{failed[0].stderr.strip()[-500:]}")
    warnings = "".join(proc.stderr for proc in procs)
    if warnings.strip():
        logger.warning("native CPU kernels built with warnings: %s", warnings[-2000:])
    return warnings


def built_level(path: Path) -> str | None:
    """The KP_ISA a library file was compiled for, read from its bytes (never by running it)."""
    data = path.read_bytes()
    at = data.find(ISA_TAG)
    if at < 0:
        return None
    end = data.find(b";", at)
    return data[at + len(ISA_TAG):end].decode(errors="replace")


def build(level: isa.IsaLevel) -> Path:
    """The library for `level` in the cache, compiling it first when it is not there."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    target = (settings.cache_dir() / "native"
              / f"kp_native-{level.name}-{build_key(compiler, level)}.so")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        compile_library(compiler, level, out)
        os.replace(out, target)  # atomic: a half-written library is never loaded
    return target


def load() -> ctypes.CDLL | None:
    """The library, built on first use; None (the reason logged once) when it is turned off,
    cannot be built, or was built for another ABI version."""
    global _lib, _level, _tried
    if _tried:
        return _lib
    _tried = True
    if not settings.native_enabled():
        logger.info("native CPU kernels disabled by %s", settings.NATIVE.name)
        return None
    try:
        level = isa.current()
    except ValueError as exc:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None
    if level is None:
        logger.warning("native CPU kernels unavailable: this CPU lacks %s (the lowest level, "
                       "%s); using the PyTorch path", ", ".join(isa.missing(
                           isa.LEVELS[0], isa.cpu_flags())), isa.LEVELS[0].doc)
        return None
    try:
        path = build(level)
        lib = ctypes.CDLL(str(path))
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
    logger.info("native CPU kernels loaded, built for %s (%s)", level.name, level.doc)
    _level = level
    return _lib


def loaded_level() -> isa.IsaLevel | None:
    """The level of the loaded library (None when none is loaded)."""
    return _level if load() is not None else None


_panel_of: tuple[object, int] = (None, 0)  # (library, its panel): one ctypes call per library


def gemm_panel() -> int:
    """Output columns per packed panel of the loaded library (`kp_gemm_panel`); 0 when no
    library is loaded."""
    global _panel_of
    lib = load()
    if lib is None:
        return 0
    if _panel_of[0] is not lib:
        _panel_of = (lib, int(lib.kp_gemm_panel()))
    return _panel_of[1]


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
