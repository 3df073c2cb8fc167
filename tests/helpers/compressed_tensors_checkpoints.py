"""compressed-tensors checkpoints (llm-compressor's format) written from the format's
definition: a float checkpoint's projections quantized with one scheme (W4A16 packed,
symmetric or not; W8A8 int8 per channel with dynamic per-token or per-tensor activations; FP8
per tensor) beside its dequantized float copy. tests/test_compressed_tensors.py and
test_w8a8.py both check the engine against these folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.int4_packing import IN_ORDER, pack_along

PROMPT = [3, 17, 42, 5, 88, 61, 9, 23]  # the prompt whose logits the tests compare
GROUP = 32
PROJ_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# scheme -> (format, weights args, input activations)
SCHEMES = {
    "w4a16": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                 "strategy": "group", "group_size": GROUP}, None),
    "w4a16_asym": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                      "strategy": "group", "group_size": GROUP}, None),
    "w8a8": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                               "strategy": "channel"},
             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
              "dynamic": True}),
    "w8a8_tensor": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                      "strategy": "channel"},
                    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                     "dynamic": True}),
    "fp8": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                "strategy": "tensor"}, None),
}


def _int4(w: torch.Tensor, symmetric: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Signed codes in [-8, 7] per group of 32 inputs, stored `q + 8` eight a word along the
    input; asymmetric zeros stored `z + 8` eight a word along the output."""
    g = w.reshape(w.shape[0], -1, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).bfloat16().float()
        zero = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).bfloat16().float()
        zero = (-8 - lo / scale).round().clamp(-8, 7)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(-8, 7)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)
    parts = {"weight_packed": pack_along((q + 8).reshape(w.shape), 1, IN_ORDER),
             "weight_scale": scale.bfloat16(), "weight_shape": torch.tensor(list(w.shape))}
    if not symmetric:
        parts["weight_zero_point"] = pack_along(zero + 8, 0, IN_ORDER)
    return parts, deq


def _quantized(w: torch.Tensor, scheme: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = w.float()
    if scheme.startswith("w4a16"):
        return _int4(w, symmetric=scheme == "w4a16")
    if scheme.startswith("w8a8"):
        scale = w.abs().amax(1, keepdim=True) / 127
        codes = (w / scale).round().clamp(-127, 127)
        return {"weight": codes.to(torch.int8), "weight_scale": scale}, codes * scale
    scale = (w.abs().amax() / 448).reshape(1)
    w8 = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": w8, "weight_scale": scale}, w8.float() * scale


def write(src: Path, dst: Path, scheme: str) -> Path:
    """`src` quantized into `dst` with `scheme`, its dequantized float copy in `dst/float`."""
    state = load_file(src / "model.safetensors")
    quantized, dense = {}, dict(state)
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJ_SUFFIXES):
            quantized[name] = w
            continue
        parts, dense[name] = _quantized(w, scheme)
        quantized |= {f"{prefix}.{leaf}": t.contiguous() for leaf, t in parts.items()}
    config = json.loads((src / "config.json").read_text())
    (dst / "float").mkdir(parents=True)
    (dst / "float/config.json").write_text(json.dumps(config))
    save_file(dense, dst / "float/model.safetensors")
    fmt, weights, acts = SCHEMES[scheme]
    qc = {"quant_method": "compressed-tensors", "format": fmt,
          "quantization_status": "compressed", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": acts}}}
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    save_file(quantized, dst / "model.safetensors")
    return dst
