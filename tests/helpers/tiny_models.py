"""Tiny random checkpoints of every model family the engine serves, and a hand-rolled paged
cache to run a model without the engine (`PagedSim`).

`CONFIGS` holds one transformers config per family and feature (GQA, biases, tied heads, RoPE
scalings, sliding windows, soft-capping, experts): the model tests compare each against
transformers, the planner test sizes each as the engine does, the speculation tests draft with
them.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from kserve_paged_engine.model_executor.attention import AttentionMetadata  # noqa: E402
from kserve_paged_engine.model_executor.models import LlamaForCausalLM  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 48
VOCAB = 97


def common_config(**kw: object) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, attn_implementation="eager")
    base.update(kw)
    return base


CONFIGS = {
    # GQA, untied head, Llama 3.1 rope scaling, old-style rope_scaling kwarg.
    "llama_gqa_llama3": lambda: LlamaConfig(**common_config(
        tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Plain MHA, tied head, attention and MLP biases (Llama puts one on o_proj too), 3 layers.
    "llama_mha_tied_bias": lambda: LlamaConfig(**common_config(
        num_key_value_heads=4, num_hidden_layers=3, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True)),
    # Mistral with head_dim != hidden/heads, window larger than any test sequence.
    "mistral_headdim": lambda: MistralConfig(**common_config(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=None,
        tie_word_embeddings=False)),
    # head_dim 64 (the AVX-512 attention loops; the 33-token prompt is a transposed-key prefill
    # run) and an intermediate size that is not a multiple of 48 (gate/up panels padded).
    "llama_hd64_inter100": lambda: LlamaConfig(**common_config(
        hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=100,
        tie_word_embeddings=False)),
    # Qwen2: q/k/v biases, tied, GQA, transformers-5 rope_parameters with linear scaling.
    "qwen2_tied": lambda: Qwen2Config(**common_config(
        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # Qwen3: RMSNorm over each head of q and k before RoPE, head_dim != hidden/heads, untied.
    "qwen3_qk_norm": lambda: Qwen3Config(**common_config(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Qwen3 with attention biases (q/k/v and o), MHA, tied.
    "qwen3_bias_tied": lambda: Qwen3Config(**common_config(
        num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True)),
    # YaRN over a 16-token original context (the test's sequences run past it), with the
    # attention factor derived from `factor`.
    "llama_yarn": lambda: LlamaConfig(**common_config(
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0})),
    # Mistral with a sliding window smaller than the test's prompts (17 and 33 tokens).
    "mistral_window": lambda: MistralConfig(**common_config(
        sliding_window=8, tie_word_embeddings=False)),
    # Gemma 2: window 8 on the even layers, attention and final soft-capping set low enough to
    # bite, query_pre_attn_scalar != head_dim, tied head, GQA.
    "gemma2_window_softcap": lambda: Gemma2Config(**common_config(
        head_dim=16, num_hidden_layers=3, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    # Gemma 3: q/k norms, local layers with their own RoPE base, a linear-scaled global rope,
    # window 8, final soft-capping, untied head, head_dim != hidden/heads.
    "gemma3_window_local_rope": lambda: Gemma3TextConfig(**common_config(
        head_dim=32, num_hidden_layers=4, sliding_window=8, final_logit_softcapping=3.0,
        query_pre_attn_scalar=32, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}})),
    # Gemma 3, MHA, tied, every layer global but one, default softcaps (none).
    "gemma3_mha_tied": lambda: Gemma3TextConfig(**common_config(
        num_key_value_heads=4, head_dim=16, num_hidden_layers=2, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"], rope_local_base_freq=500.0,
        rope_theta=20000.0)),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE (no explicit factor),
    # GQA, untied.
    "phi3_longrope": lambda: Phi3Config(**common_config(
        max_position_embeddings=256, original_max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.2 * i for i in range(8)],
            "long_factor": [3.0 + 0.5 * i for i in range(8)]})),
    # Phi-3 with a sliding window on every layer (Phi-3-mini's config has one), MHA.
    "phi3_window_mha": lambda: Phi3Config(**common_config(
        num_key_value_heads=4, sliding_window=10, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # Mixtral: 4 experts, top-2 (renormalised), GQA, untied, a sliding window past the prompts'.
    "mixtral_4x_top2": lambda: MixtralConfig(**common_config(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        sliding_window=12)),
    # Qwen3-MoE: 4 experts top-2 without renormalisation, q/k norms, the first layer dense
    # (mlp_only_layers), tied, MHA.
    "qwen3_moe_4x_top2": lambda: Qwen3MoeConfig(**common_config(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=3, num_key_value_heads=4,
        head_dim=16, tie_word_embeddings=True)),
    # Qwen3-MoE with renormalised top-2, every layer sparse, GQA.
    "qwen3_moe_norm_topk": lambda: Qwen3MoeConfig(**common_config(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
    # LongRoPE inside its original context (short factors), attention factor from the ratio
    # of max_position_embeddings to the original (Phi-3's form, no explicit `factor`).
    "qwen2_longrope": lambda: Qwen2Config(**common_config(
        tie_word_embeddings=False, max_position_embeddings=256, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that attention is far from uniform, biases and norms non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def save_random(config: Any, folder: Path, seed: int = 0, *, auto: Any = AutoModelForCausalLM,
                **save: Any) -> torch.nn.Module:
    """The one recipe for a tiny random checkpoint: transformers builds `auto`'s model for
    `config`, `randomise(seed)` sets every weight, `save_pretrained` writes it into `folder`
    (`save`: its options, e.g. max_shard_size). Returns the model as saved."""
    torch.manual_seed(seed)
    model = auto.from_config(config).eval()
    randomise(model, seed)
    model.save_pretrained(folder, **save)
    return model


def copy_default_tokenizer(folder: Path) -> None:
    """The default model's tokenizer (SmolLM2's, 49152 ids) into `folder`, for a tiny model
    over that vocabulary whose text, chat template and EOS are the real ones."""
    import shutil

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    src = Path(ensure_default_model(progress=lambda _: None))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)


def tiny_default_folder(folder: Path) -> Path:
    """A folder with the default model's config shrunk to a tiny shape and its tokenizer, and
    no weights: for loads that make their own (`load_format="dummy"`, quantized at load)."""
    import json

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    config = json.loads((Path(ensure_default_model(progress=lambda _: None))
                         / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (folder / "config.json").write_text(json.dumps(config))
    copy_default_tokenizer(folder)
    return folder


def save_checkpoint(config_fn, tmp_path: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """`save_random` of `config_fn()`, and the transformers reference read back from it."""
    save_random(config_fn(), tmp_path, seed)
    # Reload so the reference sees exactly the saved checkpoint (ties included).
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                               dtype=torch.float32, attn_implementation="eager")
    return tmp_path, ref.eval()


@dataclass
class PagedSim:
    """A hand-rolled block allocator: enough of the KV manager to build AttentionMetadata."""

    model: LlamaForCausalLM
    seed: int = 0
    num_blocks: int = NUM_BLOCKS
    block_size: int = BLOCK_SIZE
    free: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)
        shape = (2, self.num_blocks, self.block_size, self.model.num_kv_heads,
                 self.model.head_dim)
        # Large finite garbage (as a reused cache holds): a kernel that fails to mask a slot
        # it reads shows up in the logits. Not NaN: 0 * NaN would poison even masked reads.
        g = torch.Generator().manual_seed(self.seed)
        self.kv = [torch.randn(shape, generator=g) * 100 for _ in range(self.model.num_layers)]

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run new tokens of several sequences at once; return float32 logits of every token."""
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for sid, new in batch:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            end = start + len(new)
            bs = self.block_size
            while len(table) * bs < end:
                table.append(self.free.pop())
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            ids += new
            pos += range(start, end)
            starts.append(starts[-1] + len(new))
            seq_lens.append(end)
            self.lens[sid] = end
        width = max(len(self.tables[sid]) for sid, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for i, (sid, _) in enumerate(batch):
            tables[i, : len(self.tables[sid])] = torch.tensor(self.tables[sid])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_seq_len=max(seq_lens),
            max_query_len=max(len(new) for _, new in batch),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta)
            return self.model.compute_logits(hidden)


def greedy(model: torch.nn.Module, prompt: list[int], steps: int,
           kv_dtype: torch.dtype | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy tokens of `model` after `prompt` on a `PagedSim` (its KV cache in
    `kv_dtype`, None: the sim's own), and the logits of every step (the prompt's first)."""
    sim = PagedSim(model, seed=0)
    if kv_dtype is not None:
        sim.kv = [kv.to(kv_dtype) for kv in sim.kv]
    logits = sim.step([(0, prompt)])
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = sim.step([(0, [tokens[-1]])])
        rows.append(logits)
    return tokens, rows


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary, so the engine can load the folder
    (prompts go in as token ids)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",
                            eos_token="t1").save_pretrained(path)


def save_cross_encoder(path: Path, num_labels: int = 3) -> torch.nn.Module:
    """A tiny random BertForSequenceClassification with a WordPiece tokenizer in `path`;
    returns the transformers model (the reference)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat",
             "on", "mat", "is", "blue", "red", "what", "where", "ran", "fast", "slow", "##s",
             "##ed", "and"]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    config = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=48, num_labels=num_labels,
                        max_position_embeddings=64,
                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return model


def save_decoder_classifier(config_fn, path: Path, num_labels: int = 3,
                            seed: int = 0) -> torch.nn.Module:
    """A tiny random `...ForSequenceClassification` of a decoder family (its `score` head over
    the last token) with the word-level tokenizer in `path`; returns the transformers model."""
    from transformers import AutoModelForSequenceClassification

    config = config_fn()
    config.num_labels = num_labels
    config.architectures = [type(config).__name__.removesuffix("Config")
                            + "ForSequenceClassification"]
    model = save_random(config, path, seed, auto=AutoModelForSequenceClassification)
    save_tokenizer(path)
    return model
