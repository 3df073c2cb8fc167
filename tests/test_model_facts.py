"""One source of model facts: the capacity planner and the engine's start-up sizing agree on
every family, because both read the engine's own model (`ModelFacts`) and size the KV cache
with one function (`engine/kserve_paged_engine/core/kv_sizing.size_kv_cache`).

For each family's tiny config (tests/helpers/tiny_models.py): the planner reads config.json
alone; the engine loads the folder (random weights) with the same KV budget. The block count,
the bytes a block takes in the cache the engine allocated, the KV groups, the weights' bytes
and the longest request agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged.plan import make_plan, parse_device
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.model_executor.model_facts import ModelFacts, describe_folder
from tests.helpers.tiny_deepseek import DEEPSEEK_CONFIGS
from tests.helpers.tiny_gptoss import gptoss_config
from tests.helpers.tiny_models import CONFIGS as FAMILY_CONFIGS
from tests.helpers.tiny_models import save_tokenizer

# Every family's tiny configs, gpt-oss's and DeepSeek's too (their own helpers: no
# tensor-parallel cases).
CONFIGS = {**FAMILY_CONFIGS, "gpt_oss_window_sinks": gptoss_config, **DEEPSEEK_CONFIGS}
KV_BUDGET = 4 << 20  # bytes: room for the longest request of every tiny config


def _folder(name: str, tmp_path: Path) -> Path:
    CONFIGS[name]().save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_planner_and_engine_size_every_family_alike(name: str, tmp_path: Path) -> None:
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    folder = _folder(name, tmp_path)
    plan = make_plan(describe_folder(folder), parse_device("cpu:4"), dtype="float32",
                     kv_cache_memory=KV_BUDGET)
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", dtype="float32",
                                    device="cpu", kv_cache_memory=KV_BUDGET))
    try:
        held = sum(c.numel() * c.element_size() for c in engine.runner.slot_caches)
        assert engine.num_kv_blocks == plan.kv_blocks > 0
        assert held == plan.kv_bytes_per_block * plan.kv_blocks
        assert engine.kv_layout == plan.layout
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        assert weights == plan.weights_bytes
        assert engine.max_model_len == plan.max_model_len
        assert ModelFacts.of(engine.model) == describe_folder(folder)
    finally:
        engine.close()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_facts_are_those_of_the_model_code(name: str) -> None:
    """What drifted while the planner kept rules of its own: parameters (biases, q/k norms,
    experts, tied heads) are transformers' own count for the family; Gemma's layers slide as
    its layer types say."""
    from transformers import AutoModelForCausalLM

    from kserve_paged_engine.model_executor.model_facts import describe

    config = CONFIGS[name]()
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    facts = describe(config)
    assert facts.num_params == sum(p.numel() for p in reference.parameters())
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" in types:
        assert [w is not None for w in facts.layer_windows] == [
            t == "sliding_attention" for t in types]
