"""The `--quantization` values (vLLM's flag) and which can run where; no torch import, so the
server's flags and EngineConfig read them before anything heavy loads.

vLLM's values this engine recognises: `gguf`, `awq`, `gptq` and `compressed-tensors` (a GGUF's
or a quantized checkpoint's weights kept as stored) and `fp8` (vLLM's: an fp8 checkpoint, or a
float one quantized to fp8 e4m3 at load; engine/kserve_paged_engine/model_executor/quantization/fp8_checkpoints.py). Ours: `int4`
and `int8`, weight-only quantization of a float checkpoint at load
(engine/kserve_paged_engine/model_executor/quantization/layouts.py says what each does). As in vLLM, an AWQ, GPTQ,
compressed-tensors or fp8 checkpoint (config.json's `quantization_config`) is served quantized
without the flag, and a flag naming another method is an error.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "compressed-tensors", "fp8", "mxfp4", "int8",
                        "int4")
BUILT_METHODS = ("gguf", "awq", "gptq", "compressed-tensors", "fp8", "mxfp4", "int8", "int4")
# Read from the checkpoint's own quantization_config (and turned on by it, as in vLLM).
# `mxfp4`: gpt-oss's experts, read by its model (models/gpt_oss.py) and kept 4-bit.
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
# Applied at load to a float checkpoint's weights (`fp8` is both: vLLM's on-the-fly fp8).
ON_THE_FLY_METHODS = ("fp8", "int8", "int4")


def checkpoint_method(raw_config: dict) -> str | None:
    """The quant_method config.json's quantization_config names (None: a float checkpoint);
    ValueError for one this engine does not read."""
    qc = raw_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"config.json's quantization_config has quant_method {method!r}; "
                         f"this engine reads {', '.join(CHECKPOINT_METHODS)} checkpoints")
    return method


def method_error(method: str | None) -> str | None:
    """Why `method` cannot be served by this engine at all, or None."""
    if method is None or method in BUILT_METHODS:
        return None
    known = "not built yet" if method in QUANTIZATION_METHODS else "unknown"
    return (f"quantization {method!r} is {known}; this engine serves "
            f"{', '.join(BUILT_METHODS)} (vLLM's values: {', '.join(QUANTIZATION_METHODS)})")


def check_method(method: str | None, *, gguf: bool, device_type: str,
                 checkpoint: str | None = None) -> str | None:
    """The method the load runs (`method`, else the checkpoint's own `checkpoint`); ValueError
    before anything loads when it cannot run here."""
    if checkpoint is not None and method not in (None, checkpoint):
        raise ValueError(f"the checkpoint is quantized with {checkpoint} (config.json's "
                         f"quantization_config) but quantization {method!r} was asked")
    method = method or checkpoint
    if method is None:
        return None
    error = method_error(method)
    if error is not None:
        raise ValueError(error)
    if method in CHECKPOINT_METHODS and method not in ON_THE_FLY_METHODS and checkpoint != method:
        raise ValueError(f"quantization {method!r} needs a checkpoint quantized with it "
                         "(quantization_config in config.json); this one is float")
    if method == "gguf" and not gguf:
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if method != "gguf" and gguf:
        raise ValueError(f"quantization {method!r} re-quantizes a float checkpoint; a GGUF is "
                         "served with quantization 'gguf' (or none: dequantized)")
    if device_type not in ("cpu", "cuda") or (device_type == "cuda"
                                              and method not in CHECKPOINT_METHODS):
        raise ValueError(f"quantization {method!r} runs on CPU only in this engine "
                         f"(device {device_type}); {', '.join(CHECKPOINT_METHODS)} run on CUDA too")
    return method
