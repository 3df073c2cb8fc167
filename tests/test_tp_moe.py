"""Mixture-of-experts models (Mixtral, Qwen3-MoE) under tensor parallelism on CPU (gloo, one
thread per rank): TP = 2 with each expert cut along its intermediate size, and TP = 2 with
`enable_expert_parallel` (whole experts spread, tokens exchanged by all-to-all), both give
TP = 1's greedy tokens and logits (within 1e-5), with chunked prefill and steps of one token.

One pair of processes (this one and one spawned worker) serves every engine of the module
(`TPExecutor.keep`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

from kserve_paged.args import build_parser, engine_kwargs
from kserve_paged.vllm_cli import serve_argv
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.model_executor.checkpoint_files import iter_weights
from kserve_paged_engine.model_executor.expert_parallel import ExpertDispatch
from kserve_paged_engine.model_executor.models.moe import SparseMoE
from kserve_paged_engine.model_executor.moe_layout import NOT_HELD, ExpertLayout
from kserve_paged_engine.model_executor.tp_layout import TPLayout, split
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.tp_executor import TPExecutor
from tests.helpers.step_logits import record_step_logits
from tests.helpers.tiny_models import copy_default_tokenizer, save_random

LOGITS_ATOL = 1e-5
VOCAB = 255  # odd: the last vocabulary shard has a padding row


def _common(**kw: object) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    base.update(kw)
    return base


CONFIGS = {
    # 4 experts top-2 (renormalised): cut 21 + 20 of an intermediate of 41, or spread 2 + 2.
    "mixtral": lambda: MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2,
                                               intermediate_size=41)),
    # 5 experts top-2, not renormalised, the first layer dense (cut by the dense rule): the
    # experts' intermediate cut 18 + 18, or 5 experts spread unevenly 3 + 2; tied head.
    "qwen3_moe": lambda: Qwen3MoeConfig(**_common(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=36, intermediate_size=40,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
        tie_word_embeddings=True)),
}

# Different lengths and output budgets: the last steps carry two tokens, then one (a rank
# whose share of the tokens is empty still takes part in the exchanges).
PROMPTS = [[5, 17, 40, 99, 3, 61, 7, 200, 13, 8, 150, 42, 77, 31, 9, 240, 18, 4, 6],
           list(range(100, 111)), [7] * 5]
MAX_TOKENS = [9, 5, 3]


@pytest.fixture(scope="module")
def workers():
    pool = TPExecutor(2, torch.device("cpu")).keep()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for name, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        save_random(config(), folder, seed=3)
        copy_default_tokenizer(folder)
        out[name] = str(folder)
    return out


def _run(model: str, tp: int, expert_parallel: bool = False
         ) -> tuple[list[list[int]], list[torch.Tensor], LLMEngine]:
    """Greedy tokens per prompt and every step's sampling logits (the engine, closed)."""
    engine = LLMEngine(EngineConfig(
        model=model, dtype="float32", tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel, block_size=4, num_kv_blocks=32,
        max_num_batched_tokens=16, max_model_len=64))
    steps = record_step_logits(engine)
    try:
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                               ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))], steps, engine
    finally:
        engine.close()


def _assert_same(one, two) -> None:
    assert two[0] == one[0]
    assert len(two[1]) == len(one[1])
    for a, b in zip(one[1], two[1], strict=True):
        assert a.shape == b.shape
        if a.numel():
            assert (a - b).abs().max().item() < LOGITS_ATOL


def _sparse(engine: LLMEngine) -> list[SparseMoE]:
    return [m for m in engine.model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_cut_and_spread_experts_match_tp1(name: str, folders: dict[str, str],
                                              workers: TPExecutor) -> None:
    folder = folders[name]
    one = _run(folder, 1)
    cut = _run(folder, 2)
    _assert_same(one, cut)
    experts = CONFIGS[name]().num_local_experts if name == "mixtral" else 5
    # Cut: rank 0 holds every expert, the first part of each one's intermediate.
    inter = 41 if name == "mixtral" else 36
    for mlp in _sparse(cut[2]):
        assert mlp.experts_gate_up.shape[:2] == (experts, 2 * split(inter, 2, 0)[1])
        assert mlp.dispatch is None

    group = workers.group
    group.take_exchange_seconds()
    spread = _run(folder, 2, expert_parallel=True)
    _assert_same(one, spread)
    # Spread: rank 0 holds its run of whole experts; the tokens went by all-to-all (four per
    # sparse layer and step).
    first, count = split(experts, 2, 0)
    for mlp in _sparse(spread[2]):
        assert (mlp.first_expert, mlp.num_local_experts) == (first, count)
        assert mlp.experts_gate_up.shape[:2] == (count, 2 * inter)
    _, exchanges = group.take_exchange_seconds()
    assert exchanges == 4 * len(_sparse(spread[2])) * len(spread[1])


def test_expert_parallel_at_tp1_changes_nothing(folders: dict[str, str]) -> None:
    """As vLLM: with one rank, every expert is on it; the flag is accepted and changes
    nothing."""
    one = _run(folders["mixtral"], 1)
    flagged = _run(folders["mixtral"], 1, expert_parallel=True)
    assert flagged[0] == one[0]
    assert all(m.dispatch is None and m.num_local_experts == 4 for m in _sparse(flagged[2]))


def test_too_few_experts_to_spread_is_refused_before_loading(workers: TPExecutor,
                                                             tmp_path: Path) -> None:
    Qwen3MoeConfig(**_common(num_experts=1, num_experts_per_tok=1, moe_intermediate_size=8,
                             intermediate_size=16)).save_pretrained(tmp_path)
    copy_default_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="1 experts cannot be spread over tensor_parallel_size 2"):
        LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", tensor_parallel_size=2,
                               enable_expert_parallel=True, num_kv_blocks=8))
    # Refused before any rank loaded: the workers are still there for the next engine.
    assert TPExecutor._kept is workers and not workers.in_use and workers.failure is None


def test_each_rank_reads_only_its_experts(folders: dict[str, str]) -> None:
    """Rank 1's reads from the safetensors file: its cut of every expert, or with expert
    parallelism its experts whole and nothing of the others."""
    config = CONFIGS["qwen3_moe"]()
    dense = TPLayout.of(4, 2, 8, 40, VOCAB, 1, 2).weight_slice
    file = [Path(folders["qwen3_moe"]) / "model.safetensors"]
    expert = "model.layers.1.mlp.experts.{}.{}.weight"
    for parallel in (False, True):
        layout = ExpertLayout.of(config, 1, 2, parallel)
        read = dict(iter_weights(file, lambda n, lay=layout: lay.weight_slice(n, dense)))
        assert read["model.layers.0.mlp.down_proj.weight"].shape == (32, 20)  # dense rule
        assert read["model.layers.1.mlp.gate.weight"].shape == (5, 32)  # the router: whole
        if not parallel:
            assert read[expert.format(0, "gate_proj")].shape == (18, 32)
            assert read[expert.format(4, "down_proj")].shape == (32, 18)
            continue
        assert [read[expert.format(e, "up_proj")].numel() for e in range(5)] == [0] * 3 + [
            36 * 32] * 2  # experts 3 and 4 are rank 1's
        assert layout.weight_slice(expert.format(0, "up_proj"), dense) == NOT_HELD


@pytest.mark.parametrize("experts,world", [(4, 2), (5, 2), (7, 3), (8, 4), (3, 3)])
def test_owner_of_each_expert_follows_the_split(experts: int, world: int) -> None:
    from kserve_paged_engine.distributed.ranks import TPRanks

    dispatch = ExpertDispatch(TPRanks(0, world), experts)
    want = [r for r in range(world) for _ in range(split(experts, world, r)[1])]
    assert dispatch.owner(torch.arange(experts)).tolist() == want
    firsts = dispatch.first_expert(torch.arange(world)).tolist()
    assert firsts == [split(experts, world, r)[0] for r in range(world)]


@pytest.mark.parametrize("spelling", ["--enable-expert-parallel", "--enable_expert_parallel"])
def test_flag_in_both_spellings_and_through_vllm_serve(spelling: str) -> None:
    parser = build_parser()
    args = parser.parse_args(serve_argv(["/mnt/models", "--tensor-parallel-size", "2",
                                         spelling]))
    kwargs = engine_kwargs(args)
    assert kwargs["enable_expert_parallel"] is True and kwargs["tensor_parallel_size"] == 2
    assert engine_kwargs(parser.parse_args([]))["enable_expert_parallel"] is False
