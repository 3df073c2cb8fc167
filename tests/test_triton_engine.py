"""The engine end to end on the Triton backend, greedy equal to transformers in fp32 (issue 32,
item 1): tiny Llama, Qwen3, Gemma 3 (windows, soft-capping) and Mixtral checkpoints through
chunked prefill, preemption and prefix hits, n=2 forks with copy-on-write, beam search, n-gram
speculation, a LoRA batch and decode through the CUDA-graph runner's padded buffers (the
recording stand-in on CPU), with the fused layer ops in the path.

`bench/engine_equality.py`'s `run` serves each model's scenarios in the session's GPU-path
worker (tests/helpers/gpu_path_worker.py: one child process, Triton interpreted without
CUDA). Llama's scenarios but LoRA are the unmarked part; the other families and LoRA are
`slow`.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.gpu_path_worker import GpuPathWorker
from tests.kernels.interpreted import REPO

FAST = ("llama", "basic,forks,beam,ngram,graphs")
SLOW = [("llama", "lora"), ("qwen3", "basic,forks,beam,ngram,graphs"),
        ("gemma3", "basic,forks,beam,ngram"), ("mixtral", "basic,forks,beam,ngram,graphs")]


def _assert_ok(gpu_path: GpuPathWorker, model: str, scenarios: str, scenario: str) -> dict:
    """One scenario's result from the script's run of `model` over `scenarios` (run once per
    session in the GPU-path worker, the same code as `bench/engine_equality.py --json`)."""
    data = gpu_path.call("engine_equality", "run", models=[model],
                         scenarios=scenarios.split(","), dtype="float32")
    assert data["dtype"] == "float32"
    res = data["results"][f"{model}/{scenario}"]
    if res["ok"] is None:
        pytest.skip(res["skipped"])
    assert res["ok"], res.get("trace", res)
    return res


@pytest.mark.parametrize("scenario", FAST[1].split(","))
def test_llama_on_triton_equals_transformers(gpu_path: GpuPathWorker, scenario: str) -> None:
    res = _assert_ok(gpu_path, FAST[0], FAST[1], scenario)
    # What each scenario claims to cover happened (the child checks these too).
    if scenario == "basic":
        assert res["prefix_cache_hits"] > 0 and res["num_preemptions"] > 0
    if scenario in ("forks", "beam"):
        assert res["cow_copies"] > 0
    if scenario == "ngram":
        assert res["drafted"] > 0
    if scenario == "graphs":  # replays of size 4 (a padded row), 2 and 1
        assert set(res["replays"]) == {"4", "2", "1"}


@pytest.mark.slow
@pytest.mark.parametrize("model,scenarios", SLOW)
def test_families_on_triton_equal_transformers(gpu_path: GpuPathWorker, model: str,
                                               scenarios: str) -> None:
    for scenario in scenarios.split(","):
        _assert_ok(gpu_path, model, scenarios, scenario)


def test_a_wrong_token_is_reported() -> None:
    """The script's comparison fails on a differing token (fp32) and holds bf16 to its bound."""
    sys.path.insert(0, str(REPO / "bench"))
    import engine_equality as eq

    m = object.__new__(eq.Model)
    m.dtype = "float32"
    m.same([[1, 2]], [[1, 2]], "x")
    with pytest.raises(eq.Mismatch):
        m.same([[1, 3]], [[1, 2]], "x")
    m.dtype = "bfloat16"
    m.same([[1, 2, 9, 9]], [[1, 2, 3, 4]], "x")  # 2 of 4 before the divergence: the bound
    with pytest.raises(eq.Mismatch):
        m.same([[1, 9, 9, 9]], [[1, 2, 3, 4]], "x")
