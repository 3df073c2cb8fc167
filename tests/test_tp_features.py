"""Tensor parallelism with the features that refused it before (issue 51, item 1): LoRA
adapters, the quantized KV cache and the disk KV tier. TP = 2 gives TP = 1's greedy tokens on
CPU (gloo, one thread per rank) on a tiny random Llama (4 query heads, 2 KV heads: one per rank).

One pair of processes serves every engine of the module (`TPExecutor.keep`), as in
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.config.kv_tier import KVTierConfig
from kserve_paged_engine.core.kv_tier.identity import tier_identity
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.tp_executor import TPExecutor
from tests.helpers.kv_tier_engine import PROMPT, engine, flood, hits, run, tier_dirs
from tests.helpers.lora import make_adapter

PROMPTS = [[(i * 37 + k * 11) % 4000 + 10 for i in range(n)] for k, n in ((0, 9), (1, 14), (2, 6))]


@pytest.fixture(scope="module")
def workers():
    pool = TPExecutor(2, torch.device("cpu")).keep()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny base model, and two adapters: every projection at rank 4 (q/k/v and gate/up
    fused, o/down row-parallel), and q/v/down at rank 8 with rsLoRA."""
    out = tier_dirs(tmp_path_factory)
    make_adapter(out["base"], out["root"] / "all", seed=3, r=4, lora_alpha=8,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"])
    make_adapter(out["base"], out["root"] / "some", seed=5, r=8, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    return out


def _greedy(model: Path, tp: int, waves: list[list[tuple[list[int], LoRARequest | None]]],
            between=None, **config: object) -> list[list[int]]:
    """Greedy tokens of each wave's requests (one batch per wave), `between(engine)` run
    after each wave but the last."""
    eng = LLMEngine(model=str(model), dtype="float32", tensor_parallel_size=tp, block_size=4,
                    num_kv_blocks=48, max_model_len=64, **config)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    answers: list[list[int]] = []
    try:
        for w, wave in enumerate(waves):
            ids = []
            for i, (prompt, lora) in enumerate(wave):
                ids.append(f"w{w}r{i}")
                eng.add_request(ids[-1], prompt, params, lora_request=lora)
            tokens: dict[str, list[int]] = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    assert out.error is None, out.error
                    if out.finished:
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
            answers += [tokens[i] for i in ids]
            if between is not None and w < len(waves) - 1:
                between(eng)
    finally:
        eng.close()
    return answers


def test_two_adapters_in_one_batch_and_one_loaded_at_run_time(dirs, workers) -> None:
    root = dirs["root"]
    a, b = LoRARequest("all", 1, str(root / "all")), LoRARequest("some", 2, str(root / "some"))
    late = LoRARequest("some-again", 1, str(root / "some"))  # id 1 now names other content
    again = LoRARequest("all-again", 3, str(root / "all"))
    waves = [[(PROMPTS[0], a), (PROMPTS[1], b), (PROMPTS[2], None), (PROMPTS[1], a)],
             [(PROMPTS[0], late), (PROMPTS[2], again)]]

    def reload(eng: LLMEngine) -> None:  # /v1/unload_lora_adapter, then /v1/load_lora_adapter
        assert eng.remove_lora(1)
        eng.add_lora(late)
        eng.add_lora(again)

    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    one = _greedy(dirs["base"], 1, waves, reload, **lora)
    two = _greedy(dirs["base"], 2, waves, reload, **lora)
    assert two == one
    base = _greedy(dirs["base"], 1, [[(p, None) for p in PROMPTS]])
    assert one[0] != base[0] and one[1] != base[1]  # each adapter changes its answer
    assert one[2] == base[2]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantized_kv_cache(dirs, workers, kv_dtype: str) -> None:
    waves = [[(p, None) for p in PROMPTS]]
    one = _greedy(dirs["base"], 1, waves, kv_cache_dtype=kv_dtype)
    assert _greedy(dirs["base"], 2, waves, kv_cache_dtype=kv_dtype) == one


@pytest.mark.parametrize("kv_dtype", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_disk_tier_written_by_both_ranks_is_read_back_after_a_restart(
        dirs, workers, tmp_path, monkeypatch, kv_dtype: str) -> None:
    """int8: each rank's part of a file holds its heads' codes and scales."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # block keys that repeat across engines
    tier = tmp_path / "tier"
    llm = engine(dirs, "float32", tier, tensor_parallel_size=2, kv_cache_dtype=kv_dtype)
    first = run(llm, PROMPT)
    flood(llm)  # PROMPT's blocks leave the pool for the tier
    llm.engine.close()

    llm = engine(dirs, "float32", tier, tensor_parallel_size=2, kv_cache_dtype=kv_dtype)
    assert run(llm, PROMPT) == first
    assert hits(llm) == 10  # every full block before the last token, from both ranks' parts
    llm.engine.close()

    # TP = 1: another folder, none of TP = 2's files
    llm = engine(dirs, "float32", tier, kv_cache_dtype=kv_dtype)
    assert run(llm, PROMPT) == first
    assert hits(llm) == 0
    llm.engine.close()


def test_tier_identity_carries_the_tensor_parallel_size() -> None:
    args = ("model-digest", "float32", "auto", None, 4, 2, 32, 16, "sha256", b"\0" * 32)
    one, fmt1 = tier_identity(*args)
    assert tier_identity(*args, tp_size=1) == (one, fmt1)  # TP = 1's stores stay readable
    two, fmt2 = tier_identity(*args, tp_size=2)
    four, _ = tier_identity(*args, tp_size=4)
    assert len({one, two, four}) == 3
    assert fmt1.pack() != fmt2.pack()  # every file's header differs too


def test_a_tier_config_without_an_fs_tier_is_refused_under_tensor_parallelism() -> None:
    host_only = KVTierConfig(1 << 22, host_on_cpu=True)
    EngineConfig(kv_transfer_config=host_only)  # TP = 1 builds the host tier
    with pytest.raises(ValueError, match="needs an fs secondary tier"):
        EngineConfig(kv_transfer_config=host_only, tensor_parallel_size=2)
