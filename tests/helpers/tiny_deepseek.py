"""Tiny random DeepSeek-V3 and V2 checkpoints (multi-head latent attention, grouped routing).

Kept apart from tiny_models.CONFIGS, whose every entry the decoder-stack and tensor-parallel
tests run: this family has neither (models/deepseek.py says why). The model-facts test takes
both dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from tests.helpers.tiny_models import VOCAB, randomise


def _config(v2: bool = False, **kw: Any) -> DeepseekV3Config | DeepseekV2Config:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attn_implementation="eager", pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return DeepseekV2Config(**base) if v2 else DeepseekV3Config(**base)


DEEPSEEK_CONFIGS = {
    # DeepSeek-V3's shape in small: low-rank q, interleaved RoPE, the first layer dense, 8
    # routed experts in 4 groups (2 eligible), top-3, one shared expert.
    "deepseek_v3_mla": lambda: _config(),
    # No q LoRA (a plain q_proj, DeepSeek-V2-Lite's form), rotate-half RoPE, YaRN with
    # mscale_all_dim (the softmax scale grows by mscale^2), attention biases, 2 layers.
    "deepseek_v3_yarn_qproj": lambda: _config(
        q_lora_rank=None, rope_interleave=False, num_hidden_layers=2, attention_bias=True,
        max_position_embeddings=256, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2 (-Lite's shape in small: plain q_proj, softmax routing without
    # renormalisation, two shared experts), group-limited among 2 of 4 groups.
    "deepseek_v2_group_limited": lambda: _config(
        v2=True, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
        norm_topk_prob=False, routed_scaling_factor=1.5),
}


def save_deepseek(name: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random checkpoint of `DEEPSEEK_CONFIGS[name]` in `folder` (the routers' score biases
    random too: they steer which groups and experts are picked), and transformers' model
    read back from it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(DEEPSEEK_CONFIGS[name]()).eval()
    randomise(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                               dtype=torch.float32, attn_implementation="eager")
    return ref.eval()
