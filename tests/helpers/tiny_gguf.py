"""A tiny Llama GGUF written in the test, its projections in chosen block types with random
blocks (valid scales, random codes), the rest float32: what `--quantization gguf` is tested on
without any file from a hub."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QT

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 96
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# (byte offset, low, high) of each fp16 field set in a block: a scale (d) and, where the type
# has one, its minimum (Q4_1's m) or the super-block's dmin (Q4_K, Q5_K), so weights come out
# about +-0.1 (Q6_K's d sits at the end of its block, after int8 sub-block scales).
_FIELDS = {QT.Q4_0: [(0, 0.005, 0.015)], QT.Q4_1: [(0, 0.005, 0.015), (2, -0.1, -0.01)],
           QT.Q4_K: [(0, 5e-5, 1.5e-4), (2, 5e-4, 1.5e-3)], QT.Q8_0: [(0, 4e-4, 1e-3)],
           QT.Q5_K: [(0, 5e-5, 1.5e-4), (2, 5e-4, 1.5e-3)], QT.Q6_K: [(208, 1e-5, 3e-5)]}


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks `[rows, bytes per row]`: random codes and scales in a useful range."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)
    for offset, lo, hi in _FIELDS[qtype]:
        values = rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _shape(name: str) -> tuple[int, int]:
    head_dim = HIDDEN // HEADS
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
            "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
            "ffn_down": (HIDDEN, INTER)}[name]


def write(path: Path, types: dict[str, QT], seed: int = 0, vocab: QT = QT.F32) -> Path:
    """A 2-layer Llama GGUF at `path`; `types` maps a projection (`attn_q`, ..., `ffn_down`)
    to its block type, F32 for those it leaves out; `vocab` is the embedding's and the
    (untied) output's type."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def dense(rows: int, cols: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    for name in ("token_embd.weight", "output.weight"):
        if vocab == QT.F32:
            w.add_tensor(name, dense(VOCAB, HIDDEN, 1.0 if name.startswith("token") else 0.1))
        else:
            w.add_tensor(name, random_blocks(vocab, VOCAB, HIDDEN, rng), raw_dtype=vocab)
    w.add_tensor("output_norm.weight", (rng.random(HIDDEN) + 0.5).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight",
                         (rng.random(HIDDEN) + 0.5).astype(np.float32))
        for proj in _PROJECTIONS:
            name, (rows, cols) = f"blk.{layer}.{proj}.weight", _shape(proj)
            qtype = types.get(proj, QT.F32)
            if qtype == QT.F32:
                w.add_tensor(name, dense(rows, cols))
            else:
                w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
