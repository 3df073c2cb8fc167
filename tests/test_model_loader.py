"""Loading checkpoints into the engine's models: what a bad folder says, sharded and dummy
checkpoints, and how configs are read (RoPE scalings, per-layer sliding windows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.models import GemmaForCausalLM, LlamaForCausalLM  # noqa: E402
from kserve_paged_engine.model_executor.rope import rope_parameters  # noqa: E402
from tests.helpers.tiny_models import (  # noqa: E402
    CONFIGS,
    VOCAB,
    PagedSim,
    common_config,
    save_checkpoint,
    save_random,
)

ATOL = 1e-4
RTOL = 1e-4

# --- bad input -------------------------------------------------------------------------------


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("/nonexistent/model", torch.float32, torch.device("cpu"))


def test_missing_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_weights(tmp_path: Path) -> None:
    CONFIGS["llama_gqa_llama3"]().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_dummy_load_format_needs_only_the_config(tmp_path: Path) -> None:
    CONFIGS["llama_gqa_llama3"]().save_pretrained(tmp_path)  # config.json, no weights
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=3)
    again, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=3)
    other, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=4)
    params = dict(model.named_parameters())
    assert params["model.norm.weight"].eq(1).all()
    emb = params["model.embed_tokens.weight"]
    assert 0.015 < float(emb.std()) < 0.025 and abs(float(emb.mean())) < 0.005
    assert all(torch.equal(p, again.get_parameter(n)) for n, p in params.items())
    assert not torch.equal(emb, other.get_parameter("model.embed_tokens.weight"))
    logits = PagedSim(model, seed=0).step([(0, [1, 2, 3])])
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()


def test_missing_shard(tmp_path: Path) -> None:
    CONFIGS["llama_gqa_llama3"]().save_pretrained(tmp_path)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_tensor_in_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_proj"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = save_random(CONFIGS["llama_mha_tied_bias"](), tmp_path, seed=3, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(model.model.layers[2].mlp.down_proj.weight,
                               hf.model.layers[2].mlp.down_proj.weight)


def test_unsupported_rope_type() -> None:
    config = LlamaConfig(**common_config())
    config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'proportional'"):
        LlamaForCausalLM(config)


def test_dynamic_ntk_rope_matches_transformers_over_the_stretched_context(tmp_path: Path) -> None:
    """Dynamic NTK with the base fixed for the whole stretched context (max_position_embeddings
    x factor, as vLLM serves it): equal to transformers' forward over a sequence of exactly that
    length, which derives the same base, through prefill, a chunk and decodes."""
    factor, orig = 4.0, 24
    config_fn = lambda: LlamaConfig(**common_config(  # noqa: E731
        max_position_embeddings=orig, tie_word_embeddings=False,
        rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": 10000.0}))
    path, ref = save_checkpoint(config_fn, tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    length = int(orig * factor)
    assert model.max_position_embeddings == length
    seq = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = ref(torch.tensor([seq])).logits[0].float()
    sim = PagedSim(model, seed=3)
    got = [sim.step([(0, seq[:40])]), sim.step([(0, seq[40:length - 3])])]
    got += [sim.step([(0, [t])]) for t in seq[length - 3:]]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=RTOL)


def test_longrope_long_factors_past_the_original_context() -> None:
    """Positions past the original context rotate with the long factors (transformers' long set
    and attention factor), positions inside it with the short ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS["qwen2_longrope"]()
    model = LlamaForCausalLM(config)
    rotary, orig = model.rotary_emb, 64
    for seq_len, rows in ((orig, slice(0, orig)), (orig + 1, slice(orig, None))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        pos = torch.arange(rotary.max_positions, dtype=torch.int64).float()[rows]
        angles = torch.outer(pos, inv_freq)
        torch.testing.assert_close(rotary.cos[rows], angles.cos() * scale)
        torch.testing.assert_close(rotary.sin[rows], angles.sin() * scale)


def test_sliding_windows_per_layer() -> None:
    """Windows are served, not refused: any max_model_len the positions cover is accepted, and
    each layer gets its own window (or none) from the config."""
    model = LlamaForCausalLM(MistralConfig(**common_config(sliding_window=64)))
    assert model.layer_windows == [64, 64]
    model.check_max_model_len(128)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.check_max_model_len(129)
    qwen = LlamaForCausalLM(Qwen2Config(**common_config(use_sliding_window=False)))
    assert qwen.sliding_window is None and qwen.layer_windows == [None, None]
    qwen = LlamaForCausalLM(Qwen2Config(**common_config(use_sliding_window=True, sliding_window=16,
                                                  max_window_layers=1)))
    assert qwen.layer_windows == [None, 16]
    gemma = GemmaForCausalLM(CONFIGS["gemma3_window_local_rope"]())
    assert gemma.layer_windows == [8, None, 8, 8]
    assert gemma.model.layers[0].self_attn.rotary[0] is gemma.local_rotary_emb
    assert gemma.model.layers[1].self_attn.rotary[0] is gemma.rotary_emb


def test_rope_parameters_old_and_new_config_styles() -> None:
    """transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling` both work."""
    from types import SimpleNamespace

    old = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=256, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert rope_parameters(old) == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None, max_position_embeddings=64)
    assert rope_parameters(plain) == {"rope_type": "default", "rope_theta": 1e6}
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                          max_position_embeddings=64)
    assert rope_parameters(new) == {"rope_type": "default", "rope_theta": 100000.0}


