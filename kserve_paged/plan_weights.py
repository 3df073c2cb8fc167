"""The planner's weight bytes for a quantized model: its packed size, not its parameter count
times the float dtype (2-4x off for AWQ, GPTQ, GGUF or FP8).

With the weights at hand it is the tensors as stored: a GGUF's tensors (each quant type's
bytes per block, from the file's index) or the safetensors headers (packed codes, group
scales and zeros), float tensors counted at the serving dtype. With config.json alone it is
its quantization_config's rule: bits per weight plus a scale (and zero) per group, FP8's one
byte plus its scales, over the decoder projections of the engine's own model (built on the
meta device); every other parameter (embedding, LM head, norms) at the serving dtype. Both are
totals; the planner divides them over the ranks.

They are the checkpoint's packed sizes. Where the engine repacks a format for its kernels
(on CPU: int4 scale/zero pairs in the activation dtype, FP8 dequantized under bf16
activations) its resident bytes are larger (docs/tensor_parallel.md, "Multi-node").
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# A stored tensor that belongs to a quantized weight, whatever its dtype (scales, zeros).
_PACKED_LEAVES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv",
                  "input_scale", "weight_packed", "weight_zero_point", "weight_shape",
                  "weight_g_idx")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
SCALE_BYTES = 2  # AWQ/GPTQ fp16 scales, compressed-tensors' in the model's dtype


def _safetensors_bytes(files: list[Path], elem: int) -> int:
    total = 0
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        quantized = {name.rsplit(".", 1)[0] for name, t in header.items()
                     if name != "__metadata__" and t["dtype"] not in _FLOAT_DTYPES}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            stored = t["data_offsets"][1] - t["data_offsets"][0]
            module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            packed = leaf in _PACKED_LEAVES or module in quantized
            if t["dtype"] in _FLOAT_DTYPES and not packed:
                numel = 1
                for d in t["shape"]:
                    numel *= d
                stored = numel * elem  # a float weight is held in the serving dtype
            total += stored
    return total


def stored_weight_bytes(folder: Path, elem: int) -> int | None:
    """The checkpoint's tensors as a quantized load keeps them; None without weight files."""
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs:
        from kserve_paged_engine.model_executor.quantization.gguf_file import read_index

        return sum(t.data.nbytes for t in read_index(ggufs[0]).tensors.values())
    files = sorted(folder.glob("*.safetensors"))
    return _safetensors_bytes(files, elem) if files else None


def _projection_bytes(qc: dict[str, Any], out: int, inp: int, parts: list[str], elem: int
                      ) -> int:
    """One decoder projection (`parts`: the checkpoint's matrices it stacks) as `qc` stores it:
    codes, scales and zeros (and GPTQ's g_idx); an ignored one at `elem` bytes."""
    method = str(qc.get("quant_method", "")).lower()
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore")
    if ignored and any(p in ignored or p.rsplit(".", 1)[-1] in ignored for p in parts):
        return out * inp * elem
    if method in ("awq", "gptq"):
        bits, group = int(qc.get("bits", qc.get("w_bit", 4))), qc.get("group_size", 128)
        group = inp if group in (None, -1) else int(group)
        groups = -(-inp // group)
        g_idx = 4 * inp * len(parts) if method == "gptq" else 0
        return (out * inp * bits + groups * out * bits) // 8 + groups * out * SCALE_BYTES + g_idx
    if method == "fp8":
        block = qc.get("weight_block_size")
        scales = (4 * -(-out // block[0]) * -(-inp // block[1]) if block else 4 * len(parts))
        static = 4 * len(parts) if qc.get("activation_scheme") == "static" else 0
        return out * inp + scales + static
    if method == "compressed-tensors":
        groups_cfg = list((qc.get("config_groups") or {}).values())
        weights = (groups_cfg[0].get("weights") or {}) if groups_cfg else {}
        bits = int(weights.get("num_bits", 8))
        group = weights.get("group_size") or inp  # channel: one scale per row
        scales = -(-inp // int(group)) * out
        zeros = 0 if weights.get("symmetric", True) else scales
        shape = 16 * len(parts) if bits < 8 else 0  # pack-quantized keeps each weight_shape
        return out * inp * bits // 8 + scales * SCALE_BYTES + zeros + shape
    if method == "mxfp4":  # gpt-oss: only the experts (not Linear projections) are MXFP4
        return out * inp * elem
    raise ValueError(f"quant_method {method!r} has no packed-size rule")


def formula_weight_bytes(folder: Path, raw_config: dict[str, Any], elem: int) -> int:
    """config.json's rule over the engine's own model (built on the meta device): each decoder
    projection packed, every other parameter at `elem` bytes."""
    import torch
    from transformers import AutoConfig

    from kserve_paged_engine.model_executor.models import MODEL_REGISTRY, architecture_of
    from kserve_paged_engine.model_executor.quantization.layouts import hf_parts, projections

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = MODEL_REGISTRY[architecture_of(config)](config)
    qc = raw_config["quantization_config"]
    packed = dense = 0
    for name, linear in projections(model):
        out, inp = linear.weight.shape
        packed += _projection_bytes(qc, out, inp, hf_parts(name), elem)
        dense += out * inp
    # Parameters a model holds packed itself (gpt-oss's MXFP4 experts: uint8) at their bytes.
    stored = sum(p.numel() * p.element_size() for p in model.parameters()
                 if not p.is_floating_point())
    floats = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    return packed + stored + (floats - dense) * elem


def packed_weight_bytes(folder: Path, elem: int) -> int | None:
    """The whole model's weight bytes when it is quantized (GGUF, or a quantization_config),
    served with float tensors at `elem` bytes; None for a float checkpoint."""
    config_path = folder / "config.json"
    raw = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not list(folder.glob("*.gguf")) and not isinstance(raw.get("quantization_config"), dict):
        return None
    stored = stored_weight_bytes(folder, elem)
    return stored if stored is not None else formula_weight_bytes(folder, raw, elem)
