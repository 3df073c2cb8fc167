"""config.json fields the engine ignores are listed at start-up (engine/kserve_paged_engine/model_executor/config_reads.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers

from kserve_paged_engine.model_executor.config_reads import ignored_fields, recording_reads
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.models import MODEL_REGISTRY, architecture_of

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
# DeepSeek's multi-head latent attention and routed experts, small.
MLA = dict(SMALL, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, first_k_dense_replace=1)
FAMILIES = {
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(**SMALL),
    "MistralForCausalLM": lambda: transformers.MistralConfig(**SMALL, sliding_window=16),
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**SMALL),
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**SMALL),
    "Phi3ForCausalLM": lambda: transformers.Phi3Config(**SMALL),
    "Gemma2ForCausalLM": lambda: transformers.Gemma2Config(**SMALL, head_dim=16),
    "Gemma3ForCausalLM": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=16),
    "MixtralForCausalLM": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4),
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(**SMALL, num_experts=4,
                                                               moe_intermediate_size=32),
    "DeepseekV3ForCausalLM": lambda: transformers.DeepseekV3Config(**MLA, n_group=2,
                                                                   topk_group=1),
    "DeepseekV2ForCausalLM": lambda: transformers.DeepseekV2Config(**MLA),
}


def _saved(tmp_path, arch: str, extra: dict | None = None):
    config = FAMILIES[arch]()
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(extra or {})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_model_code_reads_every_field_transformers_writes_for_its_family(tmp_path, arch):
    """transformers' own config of each supported family: nothing that matters goes unread
    (a new field our model code should honour shows up here first)."""
    raw = _saved(tmp_path, arch)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with recording_reads(config) as reads, torch.device("meta"):
        MODEL_REGISTRY[architecture_of(config)](config)
    assert type(config) is type(FAMILIES[arch]())  # the recording class is gone again
    assert ignored_fields(raw, reads, getattr(config, "attribute_map", None)) == []


def test_unread_fields_are_listed_at_load_and_off_or_inert_ones_are_not(tmp_path, caplog):
    _saved(tmp_path, "LlamaForCausalLM", {"attn_temperature_tuning": True, "use_cache": True,
                                          "experimental_off_switch": False,
                                          "rope_interleaved_experiment": True})
    with caplog.at_level(logging.WARNING, logger="kserve_paged_engine"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), load_format="dummy")
    lines = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert lines == ["config.json fields this engine ignores (they change nothing here): "
                     "attn_temperature_tuning, rope_interleaved_experiment"]


def test_a_quantization_config_not_read_is_refused_not_ignored(tmp_path):
    """A checkpoint quantized by a method this engine does not read would be served wrong if
    its config were ignored, so it is refused by name before anything loads."""
    _saved(tmp_path, "LlamaForCausalLM", {"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'; this engine reads awq"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), load_format="dummy")


def test_a_config_the_model_reads_whole_logs_nothing(tmp_path, caplog):
    _saved(tmp_path, "LlamaForCausalLM")
    with caplog.at_level(logging.WARNING, logger="kserve_paged_engine"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), load_format="dummy")
    assert not [r for r in caplog.records if "ignores" in r.getMessage()]


def test_aliases_and_folded_keys_count_as_read():
    reads = {"num_local_experts", "rope_parameters", "layer_types"}
    raw = {"n_experts": 4, "rope_theta": 1e6, "max_window_layers": 28, "rope_scaling": {"a": 1},
           "brand_new": 1}
    assert ignored_fields(raw, reads, {"num_local_experts": "n_experts"}) == ["brand_new"]
