"""Tiny random gpt-oss checkpoints (transformers' `GptOssForCausalLM`) for the model, kernel and
Harmony tests: alternating sliding-window and full layers, attention sinks, biased router and
experts, YaRN RoPE; written in transformers' own (float) layout or with the experts as MXFP4
`*_blocks`/`*_scales` (the layout of the released gpt-oss checkpoints)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, GptOssConfig  # noqa: E402

from tests.helpers.tiny_models import VOCAB, randomise, save_tokenizer  # noqa: E402

# The E2M1 values a nibble codes (sign in bit 3), as the MXFP4 format defines them.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values sharing one E8M0 exponent
# What the released checkpoints leave unquantized (their config's quantization_config).
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"]}


def gptoss_config(**kw: Any) -> GptOssConfig:
    """A tiny gpt-oss config: hidden 64, 2 layers (window, full), 4 experts top-2, 4 query
    heads over 2 KV heads of 16, a window of 8 (so short tests cross it), YaRN over 32
    original positions. `kw` overrides any field (`num_hidden_layers=4`, `vocab_size=...`)."""
    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    base.update(kw)
    return GptOssConfig(**base)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` `[..., rows, cols]` (cols a multiple of 32) -> (blocks `[..., rows, cols / 32, 16]`
    uint8, two E2M1 nibbles a byte, the even column low; scales `[..., rows, cols / 32]` uint8,
    the E8M0 exponent + 127): the nearest E2M1 value under the smallest power of two that fits
    the group's largest magnitude in 6."""
    *lead, rows, cols = w.shape
    groups = w.float().reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    lut = torch.tensor(E2M1_VALUES[:8])
    mag = (groups.abs() / torch.exp2(exp)).unsqueeze(-1)
    code = (mag - lut).abs().argmin(-1).to(torch.uint8)
    code = code | ((groups < 0).to(torch.uint8) << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 `[..., rows, cols]` that (blocks, scales) code (the test-side decode)."""
    lut = torch.tensor(E2M1_VALUES)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., rows, G, 32]
    vals = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.flatten(-2)


def save_tiny_gptoss(folder: Path, seed: int = 0, *, mxfp4: bool = False, tokenizer: bool = True,
                     **config_kw: Any) -> torch.nn.Module:
    """A tiny random `GptOssForCausalLM` written into `folder` (config, safetensors and, with
    `tokenizer`, a word-level tokenizer over the tiny vocabulary). With `mxfp4` the experts are
    stored as MXFP4 blocks/scales (and the config says `quant_method: mxfp4`); the returned
    transformers model then holds exactly the dequantized values, so it is the reference
    either way (float32, eager attention)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gptoss_config(**config_kw)).eval()
    randomise(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # sinks near the scores' scale, so leaving one out shows
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
    if not mxfp4:
        model.save_pretrained(folder)
    else:
        tensors: dict[str, torch.Tensor] = {}
        for name, p in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # transformers holds [E, in, out]; the checkpoint quantizes [E, out, in] rows.
                blocks, scales = mxfp4_quantize(p.transpose(1, 2))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                with torch.no_grad():
                    p.copy_(mxfp4_dequantize(blocks, scales).transpose(1, 2))
            else:
                tensors[name] = p.detach().contiguous()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        save_tokenizer(folder)
    return model
