"""Tensor parallelism for the families beyond Llama's on CPU (gloo, one thread per rank): Gemma 2
(soft-capping, sliding windows), Gemma 3 (q/k norms, local RoPE layers, windows), Phi-3 (q/k/v
and gate/up stored fused in the checkpoint, each sub-projection cut per rank) and BERT pooling
(embeddings and a cross-encoder). TP = 2 gives TP = 1's greedy tokens and logits through
`LLMEngine` with prefix caching and chunked prefill on, Gemma's sliding and global layers in
KV groups of their own on every rank; TP = 4 on Gemma 2 (slow).

One kept pair of processes (this one and one spawned worker) serves every TP = 2 engine of the
module (`TPExecutor.keep`); each engine only loads and releases its shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.model_executor.checkpoint_files import iter_weights
from kserve_paged_engine.model_executor.tp_layout import TPLayout
from kserve_paged_engine.model_executor.tp_load import check_tensor_parallel
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.tp_executor import TPExecutor
from tests.helpers.step_logits import record_step_logits
from tests.helpers.tiny_models import CONFIGS, save_cross_encoder, save_random, save_tokenizer

# Logits within 1e-5 of the step's largest (at least 1e-5): fp32 rounding of the all-reduce's
# other summation order (and TP = 1's one-call native stack against TP = 2's per-layer
# modules), where a wrong shard moves logits by tenths.
LOGITS_RTOL = 1e-5
# A shared 12-token prefix (three 4-token blocks: prefix-cache hits), prompts past the tiny
# configs' window of 8 so the sliding layers drop keys; ids under the tiny vocabulary (97).
PREFIX = [(7 * i + 3) % 97 for i in range(12)]
PROMPTS = [PREFIX + [5, 17, 40], PREFIX + list(range(60, 80)), PREFIX + [9] * 6,
           list(range(20, 31))]
# 4-token blocks and a 16-token step budget: the 32-token prompt is chunked.
ENGINE = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=80)


@pytest.fixture(scope="module")
def workers():
    pool = TPExecutor(2, torch.device("cpu")).keep()
    yield pool
    pool.stop()


def _save(name: str, folder: Path) -> str:
    save_random(CONFIGS[name](), folder, seed=3)
    save_tokenizer(folder)
    return str(folder)


def _generate(model: str, tp: int, max_tokens: int = 6
              ) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy tokens per prompt, every step's sampling logits, and the final stats."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", tensor_parallel_size=tp,
                                    **ENGINE))
    steps = record_step_logits(engine)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
            if i == 0:  # the first request's blocks are cached before the others arrive
                while engine.has_unfinished_requests():
                    _collect(engine, tokens)
        while engine.has_unfinished_requests():
            _collect(engine, tokens)
        stats = engine.stats()
        stats["kv_groups"] = engine.runner.layout.num_groups
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))], steps, stats
    finally:
        engine.close()


def _collect(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        assert out.error is None, out.error
        if out.finished:
            tokens[out.request_id] = out.outputs[0].token_ids


def _assert_same(one, two) -> None:
    tokens1, steps1, stats1 = one
    tokens2, steps2, stats2 = two
    assert tokens2 == tokens1
    assert len(steps2) == len(steps1)
    for a, b in zip(steps1, steps2, strict=True):
        assert a.shape == b.shape
        if a.numel():
            bound = LOGITS_RTOL * max(1.0, a.abs().max().item())
            assert (a - b).abs().max().item() < bound
    assert stats2["prefix_cache_hits"] > 0 and stats2["prefix_cache_hits"] == \
        stats1["prefix_cache_hits"]
    assert stats2["kv_groups"] == stats1["kv_groups"]  # Gemma's sliding layers' own groups


@pytest.mark.parametrize(("name", "kv_groups"), [("gemma2_window_softcap", 3),
                                                ("gemma3_window_local_rope", 4),
                                                ("phi3_longrope", 1)])
def test_tp2_matches_tp1(name: str, kv_groups: int, workers: TPExecutor, tmp_path: Path
                         ) -> None:
    """Gemma's global and sliding layers in KV groups of their own at TP = 2 as at TP = 1
    (docs/kv_groups.md): every group's tables reach the worker in the step's message."""
    folder = _save(name, tmp_path)
    one, two = _generate(folder, 1), _generate(folder, 2)
    assert one[2]["kv_groups"] == kv_groups
    _assert_same(one, two)


def test_phi3_fused_tensors_cut_per_sub_projection(tmp_path: Path) -> None:
    """Rank 1 of Phi-3 (4 heads, 2 KV heads of 16, intermediate 96) reads from the fused
    `qkv_proj` its query heads 2-3, KV head 1 of k and of v; from `gate_up_proj` the second
    half of gate and of up: the rows of each sub-projection, not a run of the fused tensor."""
    folder = Path(_save("phi3_longrope", tmp_path))
    whole = dict(iter_weights([folder / "model.safetensors"]))
    layout = TPLayout.of(4, 2, 16, 96, 97, 1, 2)
    read = dict(iter_weights([folder / "model.safetensors"], layout.weight_slice))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    qkv = whole[name]
    torch.testing.assert_close(read[name], torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]),
                               rtol=0, atol=0)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    gate_up = whole[name]
    torch.testing.assert_close(read[name], torch.cat([gate_up[48:96], gate_up[144:192]]),
                               rtol=0, atol=0)


def _save_bert(folder: Path, classifier: bool) -> str:
    """A tiny random BERT (4 heads of 8, an odd vocabulary of 23: the last vocabulary shard has
    a padding row) with a WordPiece tokenizer: the cross-encoder, or a `BertModel` of its
    config (embeddings)."""
    reference = save_cross_encoder(folder)
    if not classifier:
        from transformers import BertModel

        config = reference.config
        config.architectures = ["BertModel"]
        torch.manual_seed(1)
        model = BertModel(config, add_pooling_layer=False).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        model.save_pretrained(folder)
    return str(folder)


def _pool(model: str, tp: int, prompts: list[list[int]]) -> list[torch.Tensor]:
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", tensor_parallel_size=tp,
                                    runner="pooling", num_kv_blocks=32, block_size=4,
                                    max_model_len=64))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, pooling_params=PoolingParams(task=engine.job))
        pooled: dict[str, torch.Tensor] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    pooled[out.request_id] = out.pooled
        return [pooled[f"p{i}"] for i in range(len(prompts))]
    finally:
        engine.close()


@pytest.mark.parametrize("classifier", [False, True])
def test_bert_tp2_matches_tp1(classifier: bool, workers: TPExecutor, tmp_path: Path) -> None:
    """CLS embeddings (`BertModel`) and a cross-encoder's scores: pairs `[CLS] a [SEP] b
    [SEP]` (token types from [SEP] on every rank), several prompts in one step."""
    folder = _save_bert(tmp_path, classifier)
    prompts = [[2, 7, 9, 10, 3, 8, 17, 18, 3], [2, 5, 11, 3], [2, 15, 12, 13, 3, 21, 3]]
    one, two = _pool(folder, 1, prompts), _pool(folder, 2, prompts)
    for a, b in zip(one, two, strict=True):
        assert a.shape == ((3,) if classifier else (32,))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [
    GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                 vocab_size=256),
    DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                     intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                     vocab_size=256)], ids=["gpt_oss", "deepseek_v3"])
def test_the_families_tp_does_not_cover_are_refused_before_any_rank_loads(config) -> None:
    """gpt-oss (sinks, MXFP4 experts) and DeepSeek's latent attention have no sharded form yet
    (docs/tensor_parallel.md "Scope and limits"): a start-up error naming the architecture."""
    arch = config.architectures[0] if config.architectures else type(config).__name__
    with pytest.raises(ValueError, match="is not sharded by this engine") as refusal:
        check_tensor_parallel(config, 2)
    assert arch.removesuffix("Config") in str(refusal.value)


def test_step_wire_carries_every_kv_group() -> None:
    """A step of a model in three KV groups: the workers' copy has each group's own slot
    mapping and block tables (not group 0's), with the rows and the block copies intact."""
    from kserve_paged_engine.model_executor.attention import AttentionMetadata, GroupedMetadata
    from kserve_paged_engine.worker import step_wire
    from kserve_paged_engine.worker.model_runner import StepInputs

    i32 = torch.int32

    def meta(cls, offset: int, **extra):
        return cls(slot_mapping=torch.arange(5) + offset,
                   block_tables=(torch.arange(6, dtype=i32) + offset).view(2, 3),
                   seq_lens=torch.tensor([3, 2], dtype=i32),
                   query_start_loc=torch.tensor([0, 3, 5], dtype=i32), max_seq_len=3,
                   max_query_len=3, row_lens=torch.tensor([1, 2, 3, 1, 2], dtype=i32),
                   row_seq_idx=torch.tensor([0, 0, 0, 1, 1]), backend="cpu", **extra)

    sent = meta(GroupedMetadata, 0, groups=[meta(AttentionMetadata, 100),
                                            meta(AttentionMetadata, 200)])
    inputs = StepInputs(input_ids=torch.arange(5) + 7, positions=torch.tensor([0, 1, 2, 0, 1]),
                        meta=sent, logits_indices=torch.tensor([2, 4]), sampling=[],
                        prompt_spans=[], prompt_rows=[0, 1])
    head, payload = step_wire.pack(inputs, [(3, 4)], torch.device("cpu"))
    fields = head.tolist()
    assert payload.numel() == step_wire.payload_len(fields)
    got, copies = step_wire.unpack(fields, payload, torch.device("cpu"), "cpu")
    assert copies == [(3, 4)] and got.prompt_rows == [0, 1]
    assert isinstance(got.meta, GroupedMetadata) and len(got.meta.groups) == 2
    for mine, theirs in zip([sent, *sent.groups], [got.meta, *got.meta.groups], strict=True):
        assert torch.equal(theirs.slot_mapping, mine.slot_mapping)
        assert torch.equal(theirs.block_tables, mine.block_tables)
        assert torch.equal(theirs.row_lens, mine.row_lens)


@pytest.mark.slow
def test_gemma2_tp4_matches_tp1(workers: TPExecutor, tmp_path: Path) -> None:
    """4 ranks over Gemma 2's 4 query and 2 KV heads: each KV head replicated on two ranks,
    one query head each. Runs last: the module's TP = 2 pool gives way to a TP = 4 one."""
    folder = _save("gemma2_window_softcap", tmp_path)
    one = _generate(folder, 1)
    workers.stop()
    four = TPExecutor(4, torch.device("cpu")).keep()
    try:
        _assert_same(one, _generate(folder, 4))
    finally:
        four.stop()
