"""Instruction-set levels of the native library (kernels/kserve_paged_kernels/cpu_native/isa.py).

What holds on every machine: each level's table of needed CPU flags is what gcc's `-march` for
it enables; each machine type seen chooses its level (CPU flags stubbed, so an AVX2 machine
checks the AMX choice and the other way round); every level compiles warning-free here, and the
file says which level it holds (read from its bytes, never run). A machine above AVX2 also
runs the CPU-sensitive tests as each lower level, the whole process capped:
tests/test_capped_lanes.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native import isa, loader
from tests.helpers.cpu_flags import MACHINES

# gcc's predefined macro for an instruction family -> the /proc/cpuinfo flag of that family.
_MACRO_FLAG = {
    "SSE": "sse", "SSE2": "sse2", "SSE3": "pni", "SSSE3": "ssse3", "SSE4_1": "sse4_1",
    "SSE4_2": "sse4_2", "POPCNT": "popcnt", "AVX": "avx", "AVX2": "avx2", "FMA": "fma",
    "F16C": "f16c", "BMI": "bmi1", "BMI2": "bmi2", "LZCNT": "abm", "MOVBE": "movbe",
    "AES": "aes", "PCLMUL": "pclmulqdq", "SHA": "sha_ni", "GFNI": "gfni", "VAES": "vaes",
    "VPCLMULQDQ": "vpclmulqdq", "AVX512F": "avx512f", "AVX512CD": "avx512cd",
    "AVX512BW": "avx512bw", "AVX512DQ": "avx512dq", "AVX512VL": "avx512vl",
    "AVX512VNNI": "avx512_vnni", "AVX512IFMA": "avx512ifma", "AVX512VBMI": "avx512vbmi",
    "AVX512VBMI2": "avx512_vbmi2", "AVX512BITALG": "avx512_bitalg",
    "AVX512VPOPCNTDQ": "avx512_vpopcntdq", "AVX512BF16": "avx512_bf16",
    "AVX512FP16": "avx512_fp16", "AVX512VP2INTERSECT": "avx512_vp2intersect",
    "AVXVNNI": "avx_vnni", "AMX_TILE": "amx_tile", "AMX_BF16": "amx_bf16",
    "AMX_INT8": "amx_int8",
}
# The families a compiler emits from plain C or our intrinsics (the others, such as RDRND or
# XSAVE, appear only when code asks for them by name, and ours never does).
_FAMILY = re.compile(r"#define __((?:SSE|SSSE|AVX|AMX|FMA|F16C|BMI|LZCNT|MOVBE|POPCNT|AES|"
                     r"PCLMUL|SHA|GFNI|VAES|VPCLMULQDQ)[A-Z0-9_]*)__ 1")



def _gcc() -> str:
    gcc = shutil.which("gcc")
    assert gcc is not None, "no gcc (the native kernels are built with it; see README)"
    return gcc


def _gcc_families(flags: tuple[str, ...]) -> frozenset[str]:
    proc = subprocess.run([_gcc(), *flags, "-dM", "-E", "-"], input="", capture_output=True,
                          text=True, timeout=60, check=True)
    macros = [m for m in _FAMILY.findall(proc.stdout) if not m.endswith("_MATH")]  # modes
    unknown = sorted(m for m in macros if m not in _MACRO_FLAG)
    assert not unknown, f"add these gcc macros to the table: {unknown}"
    return frozenset(_MACRO_FLAG[m] for m in macros)


@pytest.mark.parametrize("level", isa.LEVELS, ids=lambda level: level.name)
def test_each_level_needs_exactly_what_its_march_enables(level: isa.IsaLevel) -> None:
    assert _gcc_families(level.march) == level.needs


def test_levels_run_lowest_first_and_each_contains_the_first() -> None:
    assert [level.name for level in isa.LEVELS] == ["avx2", "avx512", "avx512_bf16", "amx"]
    assert all(isa.LEVELS[0].needs <= level.needs for level in isa.LEVELS)


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_each_machine_type_chooses_its_level(machine: str) -> None:
    flags, expected = MACHINES[machine]
    flags = frozenset(flags.split())
    assert isa.select(flags).name == expected
    assert [level.name for level in isa.available(flags)][-1] == expected
    for cap in isa.BY_NAME:  # a cap never lifts a machine above what it has
        chosen = isa.select(flags, cap)
        assert isa.LEVELS.index(chosen) <= min(isa.LEVELS.index(isa.BY_NAME[cap]),
                                               isa.LEVELS.index(isa.BY_NAME[expected]))
    assert isa.select(flags, "avx2").name == "avx2"


def test_a_cpu_below_avx2_gets_no_native_level_and_a_bad_cap_is_named() -> None:
    old = frozenset(["fpu", "sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx"])
    assert isa.select(old) is None
    assert isa.missing(isa.LEVELS[0], old) == sorted(isa.LEVELS[0].needs - old)
    with pytest.raises(ValueError, match="KSERVE_PAGED_ISA='avx9'.*avx2, avx512"):
        isa.select(old, "avx9")


def test_the_cap_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    spr = frozenset(MACHINES["Intel Xeon Sapphire Rapids (AMX)"][0].split())
    monkeypatch.setattr(isa, "cpu_flags", lambda: spr)
    monkeypatch.setenv("KSERVE_PAGED_ISA", "AVX512")
    assert isa.current().name == "avx512"
    monkeypatch.setenv("KSERVE_PAGED_ISA", "auto")
    assert isa.current().name == "amx"
    monkeypatch.delenv("KSERVE_PAGED_ISA")
    assert isa.current().name == "amx"


@pytest.mark.parametrize("level", isa.LEVELS, ids=lambda level: level.name)
def test_every_level_compiles_without_warnings_and_says_what_it_holds(
        level: isa.IsaLevel, tmp_path: Path) -> None:
    """Compiled here for every level (the loader's own build, warnings made errors), run only
    where the CPU has it."""
    out = tmp_path / "kp.so"
    assert loader.compile_library(_gcc(), level, out, ("-Werror",)) == ""
    assert loader.built_level(out) == level.name


@pytest.mark.slow  # a child process per machine type, seconds each
@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_each_machine_type_takes_bf16_dot_products_exactly_where_it_has_them(
        machine: str, tmp_path: Path) -> None:
    """The bf16 attention kernels' q.k path and the bf16 GEMM's products for each machine
    type's level (flags stubbed):
    `vdpbf16ps` in the compiled code iff the CPU has AVX512-BF16, as `isa.bf16_dot` says."""
    flags = frozenset(MACHINES[machine][0].split())
    level = isa.select(flags)
    assert isa.bf16_dot(level) == ("avx512_bf16" in flags)
    for name in ("paged_bf16.c", "paged_bf16_tile.c", "gemm_bf16.c"):
        asm = tmp_path / f"{name}.s"
        subprocess.run([_gcc(), *loader.FLAGS[:3], *level.march, "-S", "-o", str(asm),
                        str(loader.CSRC / name)], check=True, capture_output=True, timeout=120)
        assert ("vdpbf16ps" in asm.read_text()) == isa.bf16_dot(level), (machine, name)


def test_the_loaded_library_is_this_machines_level() -> None:
    assert cpu_native.load() is not None, "the native CPU kernels did not build"
    level = loader.loaded_level()
    assert level == isa.current()
    assert level.needs <= isa.cpu_flags()
