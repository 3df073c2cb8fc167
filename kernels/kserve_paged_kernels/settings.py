"""Every `KSERVE_PAGED_*` environment variable, read in this one place.

Why here: `kernels` is the bottom layer, so the engine and the server can both read their
settings from it without breaking the one-way imports (server -> engine -> kernels). The module
imports only the standard library, so entry points can read it before torch is loaded (the
tcmalloc re-exec, engine/kserve_paged_engine/worker/cpu_memory.py). Each setting is read when its function is called, not
at import, so a test that sets a variable with `monkeypatch.setenv` sees it take effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, the value used when it is unset, and what it does."""

    name: str
    default: str
    doc: str

    def raw(self) -> str:
        """The variable's value as set, or the default when unset."""
        return os.environ.get(self.name, self.default)


CACHE = EnvVar("KSERVE_PAGED_CACHE", "",
               "Cache folder (converted models, native library builds, tcmalloc); "
               "empty: ~/.cache/kserve-paged.")
NATIVE = EnvVar("KSERVE_PAGED_NATIVE", "1",
                "0 turns off the native C kernels for CPU; the PyTorch path serves.")
ONEDNN = EnvVar("KSERVE_PAGED_ONEDNN", "1",
                "0 turns off weight packing for CPU linear layers (plain F.linear).")
TCMALLOC = EnvVar("KSERVE_PAGED_TCMALLOC", "1",
                  "0 keeps glibc malloc: entry points do not re-execute with tcmalloc.")
KV_PREFAULT_MIB = EnvVar("KSERVE_PAGED_KV_PREFAULT_MIB", "1536",
                         "MiB of KV cache made resident at start-up (in the background where "
                         "the kernel can: engine/kserve_paged_engine/worker/kv_prefault.py).")
ATTENTION_BACKEND = EnvVar("KSERVE_PAGED_ATTENTION_BACKEND", "",
                           "cpu | triton | flash_attn (torch: old name of cpu); empty: chosen by the device.")
TORCH_DECODE_BUDGET = EnvVar("KSERVE_PAGED_TORCH_DECODE_BUDGET", "2048",
                             "Decode tokens gathered per batch by the PyTorch attention path.")
ISA = EnvVar("KSERVE_PAGED_ISA", "auto",
             "Highest instruction-set level the process runs as: auto (the CPU's best), avx2, "
             "avx512, avx512_bf16 or amx. Caps our native build and our CPU-flag reads, and "
             "sets oneDNN's, ATen's and MKL's own caps (cpu_cap.py) where they are unset, so "
             "a higher machine runs as the lower one.")
CPU_AUTO_DTYPE = EnvVar("KSERVE_PAGED_CPU_AUTO_DTYPE", "",
                        "What --dtype auto means on CPU: empty: by the CPU (bfloat16 with "
                        "native bf16, else float32); float32 or bfloat16 pins it.")
FAULT_INJECT = EnvVar("KSERVE_PAGED_FAULT_INJECT", "",
                      "TEST ONLY: a control file through which e2e tests make steps fail.")
MODEL_CONTROL_KEY = EnvVar("KSERVE_PAGED_MODEL_CONTROL_KEY", "",
                           "The key of KServe's model repository routes, as the server's "
                           "--model_control_key (kserve_paged/model_control.py); empty: "
                           "they are off.")

ALL = (CACHE, NATIVE, ONEDNN, TCMALLOC, KV_PREFAULT_MIB, ATTENTION_BACKEND, TORCH_DECODE_BUDGET,
       ISA, CPU_AUTO_DTYPE, FAULT_INJECT, MODEL_CONTROL_KEY)

_OFF = ("0", "false", "no")


def _enabled(var: EnvVar) -> bool:
    """An on/off flag: on unless set to 0, false or no (any case, blanks ignored)."""
    return var.raw().strip().lower() not in _OFF


def _integer(var: EnvVar) -> int:
    raw = var.raw().strip()
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var.name} must be an integer (got {raw!r})") from None


def cache_dir() -> Path:
    """`$KSERVE_PAGED_CACHE`, else `~/.cache/kserve-paged`."""
    raw = CACHE.raw()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "kserve-paged"


def native_enabled() -> bool:
    return _enabled(NATIVE)


def onednn_enabled() -> bool:
    return _enabled(ONEDNN)


def tcmalloc_enabled() -> bool:
    return _enabled(TCMALLOC)


def kv_prefault_mib() -> int:
    return _integer(KV_PREFAULT_MIB)


def attention_backend() -> str | None:
    """The backend named in the environment, or None to let the device decide."""
    return ATTENTION_BACKEND.raw().strip() or None


def torch_decode_budget() -> int:
    return _integer(TORCH_DECODE_BUDGET)


def model_control_key() -> str | None:
    """`$KSERVE_PAGED_MODEL_CONTROL_KEY`, None when unset or empty."""
    return MODEL_CONTROL_KEY.raw() or None


def isa_cap() -> str | None:
    """The level named by `KSERVE_PAGED_ISA`, lower-cased; None for auto (or empty)."""
    raw = ISA.raw().strip().lower()
    return None if raw in ("", "auto") else raw


def cpu_auto_dtype() -> str | None:
    """`KSERVE_PAGED_CPU_AUTO_DTYPE` (float32 or bfloat16), or None: the CPU decides."""
    raw = CPU_AUTO_DTYPE.raw().strip().lower()
    if raw in ("", "auto"):
        return None
    if raw not in ("float32", "bfloat16"):
        raise ValueError(f"{CPU_AUTO_DTYPE.name} must be float32 or bfloat16 (got {raw!r})")
    return raw


def fault_inject_path() -> str | None:
    return FAULT_INJECT.raw() or None
