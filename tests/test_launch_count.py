"""A decode step on the Triton backend with the fused layer ops launches at most 12 kernels per
Llama decoder layer (issue 32), and computes what the eager path computes, for Llama and Gemma 3.

`bench/launch_count.py`'s `count_steps` runs in the session's GPU-path worker
(tests/helpers/gpu_path_worker.py: Triton's interpreter without CUDA), counting with
`kserve_paged_kernels.launches`.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kserve_paged_kernels.launches import counting
from tests.helpers.gpu_path_worker import GpuPathWorker

MAX_PER_LAYER = 12


@pytest.fixture
def step(gpu_path: GpuPathWorker) -> dict:
    return gpu_path.call("launch_count", "count_steps", names=["llama", "gemma3"])


def test_one_decoder_layer_launches_at_most_a_dozen_kernels(step: dict) -> None:
    llama = step["llama"]
    layer = llama["layer"]
    assert layer["total"] <= MAX_PER_LAYER, layer["table"]
    # Both norms, RoPE + KV store, attention and the activation are one Triton launch each;
    # the rest is the four projections and the attention output's zero fill.
    assert layer["triton"] == {"_add_rms_norm_kernel": 2, "_rope_store_kernel": 1,
                               "_paged_attn_kernel": 1, "_act_mul_kernel": 1}, layer["table"]
    assert layer["aten"].get("mm", 0) + layer["aten"].get("addmm", 0) == 4
    assert layer["syncs"] == 0
    # The whole forward: the layers plus the embedding lookup and the final norm.
    assert llama["model"]["total"] <= MAX_PER_LAYER * llama["layers"] + 2, llama["model"]["table"]


def test_gemma_layer_uses_its_fused_norms_and_geglu(step: dict) -> None:
    """Gemma 3's four (1 + w) norms, its q/k head norms and GELU-tanh-and-multiply are fused;
    its q/k norms come before RoPE, so RoPE and the store stay separate (a fused
    norm-RoPE-store kernel is what would bring it near Llama's count)."""
    layer = step["gemma3"]["layer"]
    assert layer["triton"]["_add_rms_norm_kernel"] == 6
    assert layer["triton"]["_act_mul_kernel"] == 1
    assert "_rope_store_kernel" not in layer["triton"]
    assert layer["syncs"] == 0


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_fused_step_computes_what_the_eager_step_computes(step: dict, model: str) -> None:
    """fp32, padded row included: hidden states and every layer's cache (the padded row's slot
    -1 must write nothing) agree with the cpu backend's eager path."""
    result = step[model]
    assert result["padded"] >= 1
    assert result["max_abs_diff"] < 1e-5
    assert result["cache_max_abs_diff"] < 1e-5


def test_counter_counts_aten_kernels_but_not_views_or_allocations() -> None:
    x = torch.randn(4, 8)
    with counting() as count:
        y = x.view(8, 4).t()  # views: nothing
        z = torch.empty(3)  # allocation: nothing
        w = (x * 2).sum() + y.sum()  # mul, sum, sum, add
        assert z.numel() == 3 and float(w) != 0.5  # float(): a device-to-host read and a sync
    assert count.aten == Counter({"sum": 2, "mul": 1, "add": 1, "_local_scalar_dense": 1})
    assert count.syncs == 1 and count.total == 5 and not count.triton
