"""Compile the Triton kernels for a real GPU target (sm_90) without a GPU.

The interpreter does not catch compiled-mode errors (loop-carried type changes, constexpr
specialisation of `num_seqs == 1`, shared-memory blow-ups); Triton can lower to PTX/cubin on
a CPU-only host, so do that for a few representative specialisations. Each compile runs in a
child process with an empty Triton cache and no TRITON_INTERPRET (tests/kernels/sm90_compile.py
says why), so it is a real compile whatever ran before it in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

from tests.kernels.sm90_compile import ATTENTION_CASES  # noqa: E402

# Each compile takes seconds: the full suite's (CI runs it), not the inner loop's.
pytestmark = pytest.mark.slow

SHARED_LIMIT = 227 * 1024  # H100/H200 per-block maximum
REPO = Path(__file__).resolve().parents[2]


def _compile_in_child(case: str, cache: Path) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", case], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result["shared"]


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_kernel_compiles_for_sm90(case: str, tmp_path: Path) -> None:
    (shared,) = _compile_in_child(case, tmp_path)
    assert shared <= SHARED_LIMIT


def test_store_merge_and_block_copy_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The float store, the split-KV merge, the block copy and the quantized store (int8,
    fp8_e4m3: kernels/kserve_paged_kernels/kv_quant_triton.py)."""
    for shared in _compile_in_child("store-merge", tmp_path):
        assert shared <= SHARED_LIMIT


def test_lora_sgmv_kernels_compile_for_sm90(tmp_path: Path) -> None:
    for shared in _compile_in_child("lora-sgmv", tmp_path):
        assert shared <= SHARED_LIMIT


def test_fused_moe_kernels_compile_for_sm90(tmp_path: Path) -> None:
    for shared in _compile_in_child("fused-moe", tmp_path):
        assert shared <= SHARED_LIMIT


def test_fused_layer_ops_compile_for_sm90(tmp_path: Path) -> None:
    """add + RMSNorm (Llama, Gemma, fp32), RoPE with and without the store, SiLU / GELU."""
    shared = _compile_in_child("fused-ops", tmp_path)
    assert len(shared) == 7
    for one in shared:
        assert one <= SHARED_LIMIT


def test_quantized_weight_gemms_compile_for_sm90(tmp_path: Path) -> None:
    """AWQ and GPTQ int4, fp8 per tensor, per channel and in blocks
    (kernels/kserve_paged_kernels/quant_gemm_triton.py)."""
    shared = _compile_in_child("quant-gemm", tmp_path)
    assert len(shared) == 5
    for one in shared:
        assert one <= SHARED_LIMIT
