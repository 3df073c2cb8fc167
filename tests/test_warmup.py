"""The warm-up before readiness (issue 32, item 6) launches every Triton variant that serving
then launches: a tiny model on the Triton backend (interpreted without CUDA, in the session's
GPU-path worker: tests/helpers/gpu_path_worker.py) is warmed up, then serves prompts of several
lengths through chunked prefill and batched decode under the launch counter; every compile key
serving launched (`kserve_paged_kernels.launches.variant`) was launched by the warm-up."""

from __future__ import annotations

import pytest

from kserve_paged_engine.worker.warmup import warmup_steps
from tests.helpers.gpu_path_worker import GpuPathWorker


def _served(gpu_path: GpuPathWorker, config: str) -> dict:
    return gpu_path.call("tests.helpers.warmup_child", "served_variants", config=config)


def test_serving_launches_no_variant_the_warm_up_did_not(gpu_path: GpuPathWorker) -> None:
    result = _served(gpu_path, "llama_gqa_llama3")
    assert result["missing"] == []
    assert result["warmup"] >= 4 and result["served"] >= 4  # norms, RoPE, attention, act


@pytest.mark.slow
def test_gemma_windows_and_soft_caps_are_warmed_up_too(gpu_path: GpuPathWorker) -> None:
    assert _served(gpu_path, "gemma2_window_softcap")["missing"] == []


def test_dummy_steps_cover_decode_long_contexts_a_full_chunk_and_a_mixed_step() -> None:
    steps = warmup_steps(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=48)
    for q_lens, ctx in steps:
        assert sum(q_lens) <= 16 and len(q_lens) <= 4 and max(ctx) <= 48
        assert all(q <= c for q, c in zip(q_lens, ctx))
    kinds = {(max(q), len(q), max(c)) for q, c in steps}
    assert (1, 1, 48) in kinds and (1, 4, 48) in kinds and (16, 1, 16) in kinds
    assert any(max(q) > 1 and len(q) > 1 for q, _ in steps)  # decodes with a chunk
