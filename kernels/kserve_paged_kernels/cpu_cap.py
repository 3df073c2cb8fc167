"""`KSERVE_PAGED_ISA` as a cap on the whole process, not only on our native build.

Why: a result on CPU depends on four parties reading the CPU: our native library (its build
level), our own flag reads (VNNI for W8A8, bf16 for `--dtype auto`, AMX), oneDNN (the linear
layers, int8 products) and ATen's vectorized kernels (elementwise ops, reductions, softmax).
Capping only ours ran our choices for a lesser CPU over oneDNN and ATen still using the bigger
one, so a test passed on an AVX-512 machine that failed on a real AVX2 one (W8A8 through oneDNN
without VNNI is not the int8 product). Here each level names the same cap in the other
libraries' own variables; `apply()` sets them (never over a value the user set) when the
package is imported. oneDNN, ATen and MKL read them at their first use, so the cap holds for
any process that sets `KSERVE_PAGED_ISA` before its first tensor operation; entry points and
the test suite's capped lanes set it in the environment, before Python starts.

Standard library only: it runs from the package's `__init__`, before torch is imported.
"""

from __future__ import annotations

import os

from kserve_paged_kernels import settings

ONEDNN, ATEN, MKL = "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"

# Our level (cpu_native/isa.py `LEVELS`, same names; tests/test_capped_lanes.py holds the two
# tables together) -> the same ceiling in oneDNN's, ATen's and MKL's spelling. ATen has no level
# above avx512; AMX reaches PyTorch through oneDNN.
LIBRARY_CAPS: dict[str, dict[str, str]] = {
    "avx2": {ONEDNN: "AVX2", ATEN: "avx2", MKL: "AVX2"},
    "avx512": {ONEDNN: "AVX512_CORE_VNNI", ATEN: "avx512", MKL: "AVX512_E1"},
    "avx512_bf16": {ONEDNN: "AVX512_CORE_BF16", ATEN: "avx512", MKL: "AVX512_E3"},
    "amx": {ONEDNN: "AVX512_CORE_AMX", ATEN: "avx512", MKL: "AVX512_E4"},
}

# CPU flag families that only a level above some cap can use: under a cap, `capped_flags` drops
# every flag of these families that the cap's own levels do not need.
SIMD_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int8")


def library_environment(cap: str | None) -> dict[str, str]:
    """The oneDNN, ATen and MKL variables for `cap` (a level's name); empty for no cap. An
    unknown name is a ValueError that lists the names."""
    if cap is None:
        return {}
    if cap not in LIBRARY_CAPS:
        raise ValueError(f"{settings.ISA.name}={cap!r} is not one of "
                         f"{', '.join(['auto', *LIBRARY_CAPS])}")
    return dict(LIBRARY_CAPS[cap])


def apply(environ: os._Environ[str] | dict[str, str] | None = None) -> dict[str, str]:
    """Set the libraries' variables for `KSERVE_PAGED_ISA` in `environ` (default: this
    process), leaving any the user set; returns what it set. A bad level name is left for the
    native loader to report (it names the choices), so importing the package never fails."""
    environ = os.environ if environ is None else environ
    try:
        wanted = library_environment(settings.isa_cap())
    except ValueError:
        return {}
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    return added


def capped_flags(flags: frozenset[str], allowed: frozenset[str]) -> frozenset[str]:
    """`flags` without the SIMD families outside `allowed` (what the cap's levels need): the
    flags a CPU of the capped level would show. Non-SIMD flags pass."""
    return frozenset(f for f in flags if f in allowed or not f.startswith(SIMD_PREFIXES))
