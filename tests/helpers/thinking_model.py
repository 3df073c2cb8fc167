"""A tiny Qwen3 that thinks, deterministically: its weights make greedy decoding follow a fixed
chain of words, so the real engine produces `<think> ... </think>` answers with a Qwen3-style
chat template that honours `enable_thinking`.

How: the hidden size equals the vocabulary size and the embedding is the identity, so the
residual stream of token i is the one-hot e_i; the one decoder layer's output projections are
zero, so the stream reaches the final norm unchanged (RMSNorm of e_i is sqrt(V) e_i); the LM
head is a permutation matrix, so the next token is NEXT[i]. With thinking on, the generation
prompt ends in `assistant`, whose successor is `<think>`; with thinking off the template closes
an empty think block in the prompt, so the answer comes at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<pad>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "system", "user",
         "assistant", "Capital", "of", "France?", "The", "user", "asks", "Paris.",
         "<tool_call>", "</tool_call>"]
VOCAB = list(dict.fromkeys(WORDS))  # "user" once
# Greedy successor of each word; anything not listed goes to <|im_end|> (the end).
CHAIN = {"assistant": "<think>", "<think>": "The", "The": "user", "user": "asks",
         "asks": "</think>", "</think>": "Paris.", "Paris.": "<|im_end|>"}
REASONING, ANSWER = "The user asks", "Paris."

# Qwen3's template in miniature: roles in <|im_start|> ... <|im_end|>, and with enable_thinking
# false an empty think block closed in the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> "
    "{% endif %}{% endif %}")


def write_thinking_model(folder: Path) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    v = len(VOCAB)
    index = {w: i for i, w in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=index, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(["<pad>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    heads, head_dim = 2, 8
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": v,
        "hidden_size": v, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
        "eos_token_id": index["<|im_end|>"], "bos_token_id": None,
        "pad_token_id": index["<pad>"], "attention_bias": False}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": index["<|im_end|>"]}))
    head = torch.zeros(v, v)
    for word, i in index.items():
        head[index[CHAIN.get(word, "<|im_end|>")], i] = 1.0
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": torch.eye(v), "model.norm.weight": torch.ones(v),
        "lm_head.weight": head,
        p + "input_layernorm.weight": torch.ones(v),
        p + "post_attention_layernorm.weight": torch.ones(v),
        p + "self_attn.q_proj.weight": torch.randn(heads * head_dim, v, generator=g),
        p + "self_attn.k_proj.weight": torch.randn(head_dim, v, generator=g),
        p + "self_attn.v_proj.weight": torch.randn(head_dim, v, generator=g),
        p + "self_attn.o_proj.weight": torch.zeros(v, heads * head_dim),
        p + "self_attn.q_norm.weight": torch.ones(head_dim),
        p + "self_attn.k_norm.weight": torch.ones(head_dim),
        p + "mlp.gate_proj.weight": torch.randn(8, v, generator=g),
        p + "mlp.up_proj.weight": torch.randn(8, v, generator=g),
        p + "mlp.down_proj.weight": torch.zeros(v, 8),
    }
    save_file(weights, str(folder / "model.safetensors"))
    return folder
