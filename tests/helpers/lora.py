"""Tiny random Llama checkpoints with random PEFT adapters, and their transformers + PEFT
greedy continuations (the references of the LoRA tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_models import copy_default_tokenizer, save_random


def tiny_base(folder: Path) -> None:
    """A tiny random Llama over the default model's vocabulary and tokenizer (untied head)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="eager")
    save_random(config, folder)
    copy_default_tokenizer(folder)


def make_adapter(base: Path, folder: Path, seed: int, **kw) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    pm = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: make every delta count
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(folder)


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int
                ) -> list[list[int]]:
    """transformers (+ PEFT) greedy continuations, one prompt at a time (no padding)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
