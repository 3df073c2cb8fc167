"""The `--quantization` values (vLLM's flag) and which can run where; no torch import, so the
server's flags and EngineConfig read them before anything heavy loads.

vLLM's values this engine recognises: `gguf` (built), `awq`, `gptq`, `fp8` (not yet: a clear
error at start-up naming what is built). Ours: `int4` and `int8`, weight-only quantization of a
float checkpoint at load (engine/model_executor/quantization.py says what each does).
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "fp8", "int8", "int4")
BUILT_METHODS = ("gguf", "int8", "int4")


def method_error(method: str | None) -> str | None:
    """Why `method` cannot be served by this engine at all, or None."""
    if method is None or method in BUILT_METHODS:
        return None
    known = "not built yet" if method in QUANTIZATION_METHODS else "unknown"
    return (f"quantization {method!r} is {known}; this engine serves "
            f"{', '.join(BUILT_METHODS)} (vLLM's values: {', '.join(QUANTIZATION_METHODS)})")


def check_method(method: str | None, *, gguf: bool, device_type: str, tp: bool) -> None:
    """ValueError before anything loads when `method` cannot run here."""
    if method is None:
        return
    error = method_error(method)
    if error is not None:
        raise ValueError(error)
    if method == "gguf" and not gguf:
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if method != "gguf" and gguf:
        raise ValueError(f"quantization {method!r} re-quantizes a float checkpoint; a GGUF is "
                         "served with quantization 'gguf' (or none: dequantized)")
    if device_type != "cpu":
        raise ValueError(f"quantization {method!r} runs on CPU only in this engine "
                         f"(device {device_type})")
    if tp:
        raise ValueError(f"quantization {method!r} is not sharded: it needs "
                         "tensor_parallel_size 1")
