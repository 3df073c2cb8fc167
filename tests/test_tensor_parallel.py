"""Tensor parallelism on CPU (gloo, one thread per rank): TP = 2 gives TP = 1's greedy tokens
and logits (within 1e-5) for tiny random Llama-family configs and the default model, with
prefix caching, chunked prefill and preemption in the same run.

One pair of processes (this one and one spawned worker) serves every engine of the module: the
pool is kept (`TPExecutor.keep`) and each engine only loads and releases its shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.default_model import ensure_default_model
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.model_executor.checkpoint_files import iter_weights
from kserve_paged_engine.model_executor.tp_layout import TPLayout
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.tp_executor import TPExecutor
from tests.helpers.step_logits import record_step_logits
from tests.helpers.tiny_models import copy_default_tokenizer, save_random

LOGITS_ATOL = 1e-5
VOCAB = 49153  # odd: the last vocabulary shard has a padding row


def _common(**kw: object) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=90, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return base


CONFIGS = {
    # GQA, 2 KV heads split 1 + 1, untied head.
    "gqa_untied": lambda: LlamaConfig(**_common(tie_word_embeddings=False)),
    # One KV head, replicated on both ranks; tied head; o_proj and down_proj biases (added
    # once, by rank 0) and an intermediate size that splits 46 + 45.
    "mqa_tied_bias": lambda: LlamaConfig(**_common(
        num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        intermediate_size=91)),
    # Qwen2: 3 KV heads split 2 + 1 (6 query heads 4 + 2), q/k/v biases, tied.
    "qwen2_kv3": lambda: Qwen2Config(**_common(
        num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)),
}

PREFIX = list(range(300, 322))  # shared by every prompt: prefix-cache hits
PROMPTS = [PREFIX + [5, 17, 40], PREFIX + list(range(900, 930)), PREFIX + [7] * 9,
           list(range(2000, 2013))]


@pytest.fixture(scope="module")
def workers():
    pool = TPExecutor(2, torch.device("cpu")).keep()
    yield pool
    pool.stop()


def _save(name: str, folder: Path) -> Path:
    save_random(CONFIGS[name](), folder, seed=1)
    copy_default_tokenizer(folder)
    return folder


def _run(model: str, tp: int, prompts: list[list[int]], max_tokens: int, **config: object
         ) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy tokens per prompt, every step's sampling logits, and the final stats."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", tensor_parallel_size=tp,
                                    **config))
    steps = record_step_logits(engine)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return [tokens[f"r{i}"] for i in range(len(prompts))], steps, engine.stats()
    finally:
        engine.close()


def _assert_same(one, two, *, relative: float | None = None) -> None:
    """Same tokens; logits within 1e-5 absolute, or within `relative` of the step's largest
    logit."""
    tokens1, steps1, _ = one
    tokens2, steps2, _ = two
    assert tokens2 == tokens1
    assert len(steps2) == len(steps1)
    for a, b in zip(steps1, steps2, strict=True):
        assert a.shape == b.shape
        if a.numel():
            bound = relative * a.abs().max().item() if relative else LOGITS_ATOL
            assert (a - b).abs().max().item() < bound


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_matches_tp1_tiny(name: str, workers: TPExecutor, tmp_path: Path) -> None:
    folder = str(_save(name, tmp_path))
    # 4-token blocks, a 16-token step budget (chunked prefill) and too few blocks for all
    # four requests at once (preemption); the shared prefix hits the prefix cache.
    config = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_model_len=80)
    one = _run(folder, 1, PROMPTS, 10, **config)
    two = _run(folder, 2, PROMPTS, 10, **config)
    _assert_same(one, two)
    stats = two[2]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] == one[2]["num_preemptions"]


def test_tp2_matches_tp1_default_model(workers: TPExecutor) -> None:
    """9 heads and 3 KV heads split 6 + 3 and 2 + 1. Over 30 layers the all-reduce's other
    summation order, and the native GEMM's other blocking of a half-width shard, move logits
    of size ~14 by up to ~1.5e-4 (AVX-512/AMX builds; ~4e-5 on AVX2 and with torch's
    GEMM): within 3e-5 of the largest, fp32 rounding over 30 layers, not a wrong shard."""
    model = str(ensure_default_model(progress=lambda _: None))
    config = dict(num_kv_blocks=64, max_model_len=256)
    prompt = [[1, 504, 3458, 314, 4649, 28, 9302, 30]]
    _assert_same(_run(model, 1, prompt, 6, **config), _run(model, 2, prompt, 6, **config),
                 relative=3e-5)


def test_workers_hold_their_own_kv_share(workers: TPExecutor, tmp_path: Path) -> None:
    folder = str(_save("qwen2_kv3", tmp_path))
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32", tensor_parallel_size=2,
                                    num_kv_blocks=12, block_size=4))
    try:  # rank 0 holds KV heads 0-1, the worker head 2; both caches have 12 blocks
        assert engine.model.num_kv_heads == 2 and engine.model.num_heads == 4
        assert engine.runner.kv_caches[0].shape == (2, 12, 4, 2, 8)
        assert engine.model.lm_head.weight.shape[0] == (VOCAB + 1) // 2
    finally:
        engine.close()
    # What rank 1 reads from the safetensors file: its slices only (KV head 2, query heads
    # 4-5, the second half of the MLP and of the vocabulary).
    layout = TPLayout.of(6, 3, 8, 90, VOCAB, 1, 2)
    read = dict(iter_weights([Path(folder) / "model.safetensors"], layout.weight_slice))
    layer = "model.layers.0."
    assert read[layer + "self_attn.k_proj.weight"].shape == (8, 48)
    assert read[layer + "self_attn.q_proj.bias"].shape == (16,)
    assert read[layer + "self_attn.o_proj.weight"].shape == (48, 16)
    assert read[layer + "mlp.down_proj.weight"].shape == (48, 45)
    assert read["model.embed_tokens.weight"].shape == (VOCAB // 2, 48)
    assert read["model.norm.weight"].shape == (48,)


def test_layout_refuses_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        TPLayout.of(6, 2, 16, 64, 100, 0, 4)  # 2 KV heads over 4 ranks need 4 | heads... 6
    layout = TPLayout.of(9, 3, 64, 1536, 49152, 1, 2)
    assert layout.kv_heads == (2, 1) and layout.q_heads == (6, 3)
    assert TPLayout.of(4, 1, 8, 10, 7, 1, 2).kv_heads == (0, 1)


def test_unsplittable_heads_refuse_tp(workers: TPExecutor, tmp_path: Path) -> None:
    from transformers import Gemma2Config

    # One KV head and 3 query heads: replicated KV over 2 ranks needs the query heads even.
    Gemma2Config(**_common(head_dim=12, num_attention_heads=3, num_key_value_heads=1)
                 ).save_pretrained(tmp_path)
    copy_default_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="does not divide this model"):
        LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", tensor_parallel_size=2,
                               num_kv_blocks=8))
    # Refused before any rank loaded: the workers are still there for the next engine.
    assert TPExecutor._kept is workers and not workers.in_use and workers.failure is None


def _pool(model: str, tp: int, prompts: list[list[int]], **config: object
          ) -> list[torch.Tensor]:
    """Each prompt's pooled result (embedding or logits) from an engine of TP = `tp`."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", tensor_parallel_size=tp,
                                    runner="pooling", **config))
    try:
        task = engine.job
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, pooling_params=PoolingParams(task=task))
        pooled: dict[str, torch.Tensor] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    pooled[out.request_id] = out.pooled
        assert engine.kv.num_free_blocks == engine.num_kv_blocks
        return [pooled[f"p{i}"] for i in range(len(prompts))]
    finally:
        engine.close()


@pytest.mark.parametrize("classifier", [False, True])
def test_tp2_pooling_matches_tp1(classifier: bool, workers: TPExecutor, tmp_path: Path) -> None:
    """Embeddings (last token, normalised) and a decoder classifier's logits: pooled on rank 0
    from the all-reduced hidden states, equal to the unsharded engine's, chunked prefill on."""
    if classifier:
        config = CONFIGS["gqa_untied"]()
        config.num_labels, config.architectures = 3, ["LlamaForSequenceClassification"]
        torch.manual_seed(0)
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
        copy_default_tokenizer(tmp_path)
        folder = str(tmp_path)
    else:
        folder = str(_save("gqa_untied", tmp_path))
    config = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_model_len=80)
    one = _pool(folder, 1, PROMPTS, **config)
    two = _pool(folder, 2, PROMPTS, **config)
    for a, b in zip(one, two, strict=True):
        assert a.shape == ((3,) if classifier else (48,))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
