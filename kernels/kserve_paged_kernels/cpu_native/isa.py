"""Which instruction-set level the native library is built for on this CPU.

Why not `-march=native`: a build for "whatever this CPU has" cannot be tested anywhere else, and
a test written on one machine type then fails on another (it happened: AVX-512-only tests written
on an AVX2 machine). Instead the library is built for one of a few named levels, each a gcc
`-march` target; the highest level whose instructions this CPU has is chosen (`select`, a pure
function of the CPU's flags, so every machine type's choice is unit-tested on any machine), and
`KSERVE_PAGED_ISA` caps it, as oneDNN's `ONEDNN_MAX_CPU_ISA` does, so the lower paths run on a
higher machine. The suite compiles every level on every machine (compile only: a level is never
run on a CPU that lacks it).

`needs` lists the /proc/cpuinfo flags of every instruction family the level's `-march` lets the
compiler emit; tests/kernels/test_isa.py derives the same set from gcc's own predefined macros,
so the table cannot promise a level to a CPU that would die on an illegal instruction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kserve_paged_kernels import cpu_cap, settings

logger = logging.getLogger("kserve_paged_kernels")

_SSE = frozenset({"sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt"})
_V3 = _SSE | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
_CASCADELAKE = _V3 | {"aes", "pclmulqdq", "avx512f", "avx512cd", "avx512bw", "avx512dq",
                      "avx512vl", "avx512_vnni"}
_ICELAKE = _CASCADELAKE | {"sha_ni", "gfni", "vaes", "vpclmulqdq", "avx512ifma", "avx512vbmi",
                           "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq"}


@dataclass(frozen=True, slots=True)
class IsaLevel:
    """One build target: its name (`KSERVE_PAGED_ISA`, the C tag `KP_ISA`), the compiler flags
    that select it, and the CPU flags it needs."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]
    doc: str


# Lowest first. Sapphire Rapids' -march also enables AVX512-VP2INTERSECT, which the Sapphire
# Rapids parts seen here do not report: it is switched off so the level fits them.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", ("-march=x86-64-v3",), frozenset(_V3),
             "AVX2 + FMA (Haswell and later, AMD Zen)"),
    IsaLevel("avx512", ("-march=icelake-server",), frozenset(_ICELAKE),
             "AVX-512 F/BW/DQ/VL/VNNI/VBMI (Ice Lake server and later)"),
    IsaLevel("avx512_bf16", ("-march=cooperlake",), frozenset(_CASCADELAKE | {"avx512_bf16"}),
             "AVX-512 with the BF16 dot products (Cooper Lake, Zen 4 and later)"),
    IsaLevel("amx", ("-march=sapphirerapids", "-mno-avx512vp2intersect"),
             frozenset(_ICELAKE | {"avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                                   "amx_bf16", "amx_int8"}),
             "AMX tiles, AVX512-BF16 and -FP16 (Sapphire Rapids and later)"),
)
BY_NAME = {level.name: level for level in LEVELS}


def bf16_dot(level: IsaLevel) -> bool:
    """Whether `level`'s build takes bf16 q.k products with `vdpbf16ps` (its -march enables
    AVX512-BF16: csrc/paged_bf16.c, paged_bf16_tile.c); the other levels widen bf16 exactly to
    fp32 and use FMAs."""
    return "avx512_bf16" in level.needs


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as every choice of ours reads them: the machine's (`machine_flags`)
    under `KSERVE_PAGED_ISA`'s cap, so a capped process chooses W8A8, bf16 and AMX paths as
    the lesser CPU would (oneDNN and ATen are capped alike: cpu_cap.py)."""
    flags, cap = machine_flags(), settings.isa_cap()
    if cap is None:
        return flags
    if cap not in BY_NAME:
        raise ValueError(f"{settings.ISA.name}={cap!r} is not one of "
                         f"{', '.join(['auto', *BY_NAME])}")
    allowed = frozenset().union(*(lv.needs for lv in LEVELS[:LEVELS.index(BY_NAME[cap]) + 1]))
    return cpu_cap.capped_flags(flags, allowed)


def machine_flags() -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo; empty where there is none (not Linux on x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def select(flags: frozenset[str], cap: str | None = None) -> IsaLevel | None:
    """The highest level whose needs are all in `flags`, at most `cap` (a level's name; None:
    no cap). None when even the lowest level does not fit (the PyTorch path serves). An
    unknown cap is a ValueError that lists the names."""
    if cap is not None and cap not in BY_NAME:
        raise ValueError(f"{settings.ISA.name}={cap!r} is not one of "
                         f"{', '.join(['auto', *BY_NAME])}")
    limit = LEVELS.index(BY_NAME[cap]) if cap else len(LEVELS) - 1
    for level in reversed(LEVELS[:limit + 1]):
        if level.needs <= flags:
            return level
    return None


def missing(level: IsaLevel, flags: frozenset[str]) -> list[str]:
    """The flags `level` needs that `flags` lacks, sorted (for the log)."""
    return sorted(level.needs - flags)


def available(flags: frozenset[str] | None = None) -> list[IsaLevel]:
    """Every level this machine can run (whatever the cap), lowest first."""
    flags = machine_flags() if flags is None else flags
    return [level for level in LEVELS if level.needs <= flags]


def current() -> IsaLevel | None:
    """The level for this CPU and `KSERVE_PAGED_ISA`."""
    return select(cpu_flags(), settings.isa_cap())
