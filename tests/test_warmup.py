"""The warm-up before readiness (issue 32, item 6) launches every Triton variant that serving
then launches: a tiny model on the Triton backend (interpreted in a child process without
CUDA: tests/kernels/interpreted.py says why) is warmed up, then serves prompts of several
lengths through chunked prefill and batched decode under the launch counter; every compile key
serving launched (`kernels.launches.variant`) was launched by the warm-up."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from engine.worker.warmup import warmup_steps
from tests.kernels.interpreted import REPO, child_env


def _child(config: str) -> dict:
    pytest.importorskip("transformers")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.warmup_child", config],
                          cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_serving_launches_no_variant_the_warm_up_did_not() -> None:
    result = _child("llama_gqa_llama3")
    assert result["missing"] == []
    assert result["warmup"] >= 4 and result["served"] >= 4  # norms, RoPE, attention, act


@pytest.mark.slow
def test_gemma_windows_and_soft_caps_are_warmed_up_too() -> None:
    assert _child("gemma2_window_softcap")["missing"] == []


def test_dummy_steps_cover_decode_long_contexts_a_full_chunk_and_a_mixed_step() -> None:
    steps = warmup_steps(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=48)
    for q_lens, ctx in steps:
        assert sum(q_lens) <= 16 and len(q_lens) <= 4 and max(ctx) <= 48
        assert all(q <= c for q, c in zip(q_lens, ctx))
    kinds = {(max(q), len(q), max(c)) for q, c in steps}
    assert (1, 1, 48) in kinds and (1, 4, 48) in kinds and (16, 1, 16) in kinds
    assert any(max(q) > 1 and len(q) > 1 for q, _ in steps)  # decodes with a chunk
