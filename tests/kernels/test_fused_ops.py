"""kserve_paged_kernels.fused_ops picks the kernel: on CPU the native library (fp32) unless the triton
backend is forced under the interpreter, and nothing (None / False, the caller's eager path)
where no kernel takes the call; never Triton on CPU tensors otherwise. The Triton side is
tests/kernels/test_fused_triton.py and tests/test_launch_count.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kserve_paged_kernels import cpu_native, fused_ops
from kserve_paged_kernels.reference import act_mul_ref, add_rms_norm_ref
from tests.helpers.layout import pythonpath
from tests.kernels.interpreted import REPO


@pytest.fixture(autouse=True)
def _plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KSERVE_PAGED_ATTENTION_BACKEND", raising=False)


def test_cpu_fp32_goes_native_and_the_rest_to_the_caller() -> None:
    x, res, w = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32) + 0.5
    want, want_sum = add_rms_norm_ref(x, res, w, 1e-6)
    got = fused_ops.add_rms_norm(x, res, w, 1e-6)
    if cpu_native.load() is None:
        assert got is None
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res, want_sum)  # updated in place
        gate_up = torch.randn(2, 16)
        torch.testing.assert_close(fused_ops.act_mul(gate_up), act_mul_ref(gate_up),
                                   atol=1e-6, rtol=1e-5)
        bf16 = torch.randn(2, 16).to(torch.bfloat16)  # GeGLU in bf16: native (gemma_bf16.c)
        assert torch.equal(fused_ops.act_mul(bf16, gelu=True), act_mul_ref(bf16, gelu=True))
    # No native Gemma norm from the raw weight (GemmaRMSNorm calls cpu_native with its 1 + w),
    # fp32 GELU (inside the GEMM) or fused RoPE + store on CPU: the caller's eager path.
    assert fused_ops.add_rms_norm(x, None, w, 1e-6, gemma=True) is None
    assert fused_ops.act_mul(torch.randn(2, 16), gelu=True) is None
    qkv, cos = torch.randn(2, 64), torch.randn(10, 8)
    assert fused_ops.rope_store_(qkv, torch.tensor([0, 1]), cos, cos, 2, 1) is False
    assert fused_ops.triton_module("norm_triton", torch.device("cpu"), "triton") is None


def test_forced_triton_on_cpu_needs_the_interpreter_and_interpreted_kernels() -> None:
    """A child: with the backend forced and no interpreter, or with kernels imported compiled
    before the interpreter was switched on, the CPU call falls back instead of failing."""
    code = (
        "import os, torch\n"
        "os.environ['KSERVE_PAGED_ATTENTION_BACKEND'] = 'triton'\n"
        "from kserve_paged_kernels import fused_ops\n"
        "cpu = torch.device('cpu')\n"
        "assert fused_ops.triton_module('norm_triton', cpu) is None  # no interpreter\n"
        "import kserve_paged_kernels.norm_triton  # compiled: TRITON_INTERPRET unset at definition\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "assert fused_ops.triton_module('norm_triton', cpu) is None  # compiled kernels\n"
        "assert fused_ops.add_rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-6,"
        " gemma=True) is None\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath()}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    if "No module named 'triton'" in proc.stderr:
        pytest.skip("Triton is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_rope_store_is_never_taken_under_autograd() -> None:
    with torch.enable_grad():
        qkv = torch.randn(2, 64, requires_grad=True)
        assert fused_ops.rope_store_(qkv, torch.tensor([0, 1]), torch.randn(4, 8),
                                     torch.randn(4, 8), 2, 1, backend="triton") is False
