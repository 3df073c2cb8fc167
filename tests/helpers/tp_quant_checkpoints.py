"""Tiny quantized Llama checkpoints for tests/test_tp_quantized.py, each written from one float
checkpoint with the formats' own packing (tests/helpers/int4_packing.py for AWQ and GPTQ,
compressed_tensors_checkpoints.py for compressed-tensors, fp8 here), never the engine's
readers; and a tiny GGUF (tiny_gguf.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from tests.helpers import compressed_tensors_checkpoints
from tests.helpers.int4_packing import checkpoint_parts
from tests.helpers.tiny_models import copy_default_tokenizer, save_random

PROJ_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def float_llama(folder: Path, **overrides: object) -> Path:
    """A 2-layer Llama, 4 query and 2 KV heads of 16, MLP 128 (whole groups of 32 on each of
    2 or 4 ranks), an untied head over 256 ids, and the default model's tokenizer."""
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    save_random(LlamaConfig(**(config | overrides)), folder, seed=3)
    copy_default_tokenizer(folder)
    return folder


def _requantized(src: Path, dst: Path, parts_of: Callable[[torch.Tensor], dict],
                 quantization_config: dict) -> Path:
    """`src` with each projection's weight replaced by `parts_of(weight)`'s tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.endswith(PROJ_SUFFIXES):
            out |= {f"{prefix}.{leaf}": t.contiguous() for leaf, t in parts_of(w).items()}
        else:
            out[name] = w
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {
        "quantization_config": quantization_config}))
    save_file(out, dst / "model.safetensors")
    copy_default_tokenizer(dst)
    return dst


def int4(src: Path, dst: Path, method: str, group: int = 32, act_order: bool = False) -> Path:
    """An AWQ (gemm) or GPTQ checkpoint of `src`, 4-bit in groups of `group` inputs; GPTQ with
    `act_order` has its inputs' groups shuffled (`desc_act`)."""
    gen = torch.Generator().manual_seed(5)

    def parts(w: torch.Tensor) -> dict:
        g_idx = torch.arange(w.shape[1]) // group
        if act_order:
            g_idx = g_idx[torch.randperm(w.shape[1], generator=gen)]
        return checkpoint_parts(w.float(), g_idx, method)[0]

    qc: dict = {"quant_method": method, "bits": 4, "group_size": group}
    qc |= ({"version": "gemm", "zero_point": True} if method == "awq"
           else {"desc_act": act_order, "checkpoint_format": "gptq"})
    return _requantized(src, dst, parts, qc)


def fp8(src: Path, dst: Path, block: tuple[int, int] | None = None) -> Path:
    """An fp8 (e4m3) checkpoint of `src`: one scale per tensor, or one per `block` tile
    (`weight_scale_inv`, multiplied)."""
    def parts(w: torch.Tensor) -> dict:
        w = w.float()
        if block is None:
            scale = (w.abs().amax() / E4M3_MAX).reshape(1)
            return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
        bn, bk = block
        tiles = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
        scale = tiles.abs().amax((1, 3)) / E4M3_MAX
        codes = (tiles / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale_inv": scale}

    qc: dict = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    return _requantized(src, dst, parts, qc)


def compressed(src: Path, dst: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint of `src` (`scheme`: compressed_tensors_checkpoints'
    SCHEMES), with the tokenizer."""
    compressed_tensors_checkpoints.write(src, dst, scheme)
    copy_default_tokenizer(dst)
    return dst
