"""Quantized checkpoints written from their formats' definitions on a tiny float checkpoint,
each beside its dequantized float copy (`dst/float`, the reference): vLLM's `fp8` method and
AWQ/GPTQ 4-bit. Shared by the format tests and the planner's packed-size tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.int4_packing import checkpoint_parts

PROJ_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT4_GROUP = 32
IGNORED = "model.layers.1.mlp.down_proj"
# scheme -> (activation_scheme, weight_block_size)
SCHEMES = {"tensor": ("dynamic", None), "tensor_static": ("static", None),
           "blocks": ("dynamic", [32, 32])}


def _fp8(w: torch.Tensor, block: list[int] | None) -> tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]:
    """e4m3 codes of `w` with scale max |w| / 448 for the tensor or for each [bn, bk] tile
    (stored `weight_scale_inv`, multiplied), and the float weight they stand for."""
    if block is None:
        scale = w.abs().amax() / 448
        codes = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": scale}, codes.float() * scale
    bn, bk = block
    n, k = w.shape
    tiles = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
    scale = tiles.reshape(tiles.shape[0] // bn, bn, -1, bk).amax((1, 3)) / 448
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full


def write_fp8(src: Path, dst: Path, scheme: str) -> Path:
    """`src` as an fp8 checkpoint in `dst`, its dequantized float copy in `dst/float`."""
    acts, block = SCHEMES[scheme]
    state = load_file(src / "model.safetensors")
    quantized, dense = {}, dict(state)
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJ_SUFFIXES) or prefix == IGNORED:
            quantized[name] = w
            continue
        parts, dense[name] = _fp8(w.float(), block)
        if acts == "static":
            parts["input_scale"] = torch.tensor(0.05)
        quantized |= {f"{prefix}.{leaf}": t.contiguous() for leaf, t in parts.items()}
    config = json.loads((src / "config.json").read_text())
    (dst / "float").mkdir(parents=True)
    (dst / "float/config.json").write_text(json.dumps(config))
    save_file(dense, dst / "float/model.safetensors")
    qc = {"quant_method": "fp8", "activation_scheme": acts, "ignored_layers": [IGNORED]}
    if block is not None:
        qc["weight_block_size"] = block
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    save_file(quantized, dst / "model.safetensors")
    return dst


def write_int4(src: Path, dst: Path, method: str, act_order: bool = False) -> Path:
    """`src`'s checkpoint quantized into `dst` as `method`, and its dequantized float copy in
    `dst/float` (the reference)."""
    state = load_file(src / "model.safetensors")
    quantized, dense = {}, dict(state)
    gen = torch.Generator().manual_seed(1)
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJ_SUFFIXES):
            quantized[name] = w
            continue
        g_idx = torch.arange(w.shape[1]) // INT4_GROUP
        if act_order:
            g_idx = g_idx[torch.randperm(w.shape[1], generator=gen)]
        parts, dense[name] = checkpoint_parts(w, g_idx, method)
        quantized |= {f"{prefix}.{leaf}": t for leaf, t in parts.items()}
    config = json.loads((src / "config.json").read_text())
    (dst / "float").mkdir(parents=True)
    (dst / "float/config.json").write_text(json.dumps(config))
    save_file(dense, dst / "float/model.safetensors")
    qc = {"quant_method": method, "bits": 4, "group_size": INT4_GROUP}
    qc |= {"version": "gemm", "zero_point": True} if method == "awq" else {"desc_act": act_order}
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    save_file(quantized, dst / "model.safetensors")
    return dst
