"""The native library's ABI: csrc/kp_native.h, the ctypes table in cpu_native/abi.py and the
version check agree; the build cache key follows the CPU; the sources compile warning-free."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
import sys

import pytest

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native import abi, isa, loader

HEADER = loader.CSRC / "kp_native.h"
_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
            "float": ctypes.c_float}
_STRUCTS = {"kp_decoder_stack": abi.DecoderStackStruct, "kp_decoder_step": abi.DecoderStepStruct}


def _header_text() -> str:
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _ctype(decl: str) -> type | None:
    """`const float *` -> c_void_p, `int64_t` -> c_int64, `const kp_decoder_stack *` -> its
    ctypes pointer, `void` -> None."""
    words = decl.replace("*", " * ").replace("const", " ").split()
    base, depth = words[0], words.count("*")
    if depth == 0:
        return None if base == "void" else _SCALARS[base]
    if base in _STRUCTS:
        assert depth == 1
        return ctypes.POINTER(_STRUCTS[base])
    return ctypes.c_void_p if depth == 1 else ctypes.POINTER(ctypes.c_void_p)


def header_functions() -> dict[str, tuple[type | None, tuple[type | None, ...]]]:
    found = {}
    for ret, name, params in re.findall(r"KP_API\s+([\w\s\*]+?)\s*\b(kp_\w+)\s*\(([^)]*)\)\s*;",
                                        _header_text()):
        args = [] if params.strip() == "void" else [
            _ctype(re.sub(r"\w+\s*$", "", p.strip())) for p in params.split(",")]
        found[name] = (_ctype(ret), tuple(args))
    return found


def header_struct(name: str) -> list[tuple[str, type]]:
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + r"\s*;", _header_text(), re.S)
    assert body, name
    fields = []
    for decl in filter(str.strip, body.group(1).split(";")):
        base = decl.replace("*", " ").replace("const", " ").split()[0]
        for part in decl.split(","):  # `const float *a, *b`: each declarator has its own stars
            stars = part.count("*")
            ctype = _SCALARS[base] if stars == 0 else (
                ctypes.c_void_p if stars == 1 else ctypes.POINTER(ctypes.c_void_p))
            fields.append((re.findall(r"\w+", part)[-1], ctype))
    return fields


def test_ctypes_table_matches_the_header() -> None:
    declared = header_functions()
    assert set(declared) == set(abi.FUNCTIONS), "functions differ between header and abi.py"
    for name, (restype, argtypes) in abi.FUNCTIONS.items():
        assert declared[name] == (restype, argtypes), name


@pytest.mark.parametrize(("c_name", "mirror"), list(_STRUCTS.items()))
def test_struct_mirrors_match_the_header(c_name: str, mirror: type) -> None:
    assert header_struct(c_name) == list(mirror._fields_)


def test_versions_and_constants_agree() -> None:
    text = HEADER.read_text()
    assert int(re.search(r"#define KP_ABI_VERSION (\d+)", text).group(1)) == abi.ABI_VERSION
    assert int(re.search(r"#define KP_LORA_MAX_RANK (\d+)", text).group(1)) == abi.LORA_MAX_RANK
    formats = {"int8": "INT8", "float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}
    assert {name: int(re.search(rf"#define KP_KV_{macro} (\d+)", text).group(1))
            for name, macro in formats.items()} == abi.KV_FORMATS
    assert int(re.search(r"#define KP_QUANT_E4M3 (\d+)", text).group(1)) == abi.QUANT_E4M3


def _header_macro(level: isa.IsaLevel, name: str) -> int:
    """A macro of kp_native.h as the compiler sees it for `level`."""
    compiler = loader.find_compiler()
    assert compiler is not None, "no C compiler (the native kernels need one; see README)"
    proc = subprocess.run([compiler, *level.march, "-dM", "-E", str(HEADER)],
                          capture_output=True, text=True, check=True, timeout=60)
    return int(re.search(rf"#define {name} (\d+)", proc.stdout).group(1))


def test_the_panel_width_follows_the_level_and_python_reads_the_librarys() -> None:
    """KP_GEMM_PANEL is per level (3 AVX-512 vectors, 2 AVX2 ones); packing takes the loaded
    library's, which is the header's for the loaded level."""
    widths = {level.name: _header_macro(level, "KP_GEMM_PANEL") for level in isa.LEVELS}
    assert widths == {"avx2": 16, "avx512": 48, "avx512_bf16": 48, "amx": 48}
    lib = cpu_native.load()
    assert lib is not None, "the native CPU kernels did not build"
    assert lib.kp_gemm_panel() == cpu_native.gemm_panel() == widths[loader.loaded_level().name]


def test_loaded_library_exports_the_table_and_its_version() -> None:
    lib = cpu_native.load()
    assert lib is not None, "the native CPU kernels did not build"
    assert lib.kp_abi_version() == abi.ABI_VERSION
    for name in abi.FUNCTIONS:
        assert hasattr(lib, name)


def test_library_of_another_abi_version_is_rejected(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    assert cpu_native.load() is not None
    monkeypatch.setattr(loader, "_tried", False)
    monkeypatch.setattr(loader, "_lib", None)
    monkeypatch.setattr(abi, "ABI_VERSION", abi.ABI_VERSION + 1)
    with caplog.at_level(logging.WARNING, logger="kserve_paged_kernels"):
        assert loader.load() is None
    assert "ABI version" in caplog.text


def test_build_key_follows_the_level_and_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache shared by an AVX-512 machine and an AVX2 one must hold two libraries."""
    compiler = loader.find_compiler()
    assert compiler is not None, "no C compiler (the native kernels need one; see README)"
    avx2, avx512 = isa.BY_NAME["avx2"], isa.BY_NAME["avx512"]
    # The same machine in another process finds the same library (no per-process salt such as
    # Python's randomised hash() in the key).
    other = subprocess.run(
        [sys.executable, "-c", "from kserve_paged_kernels.cpu_native import isa, loader; "
         f"print(loader.build_key({compiler!r}, isa.BY_NAME['avx2']))"],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "random"}).stdout.strip()
    assert other == loader.build_key(compiler, avx2)
    assert loader.build_key(compiler, avx2) != loader.build_key(compiler, avx512)
    monkeypatch.setattr(loader, "_first_line", lambda cmd: "gcc (other) 99.0")
    assert loader.build_key(compiler, avx2) != other
