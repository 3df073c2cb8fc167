"""The warm-up before readiness (issue 32, item 6) launches every Triton variant that serving
then launches: a tiny model on the Triton backend (interpreted without CUDA, in the session's
GPU-path worker: tests/helpers/gpu_path_worker.py) is warmed up, then serves prompts of several
lengths through chunked prefill and batched decode under the launch counter; every compile key
serving launched (`kserve_paged_kernels.launches.variant`) was launched by the warm-up."""

from __future__ import annotations

import pytest
import torch

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


# (heads, kv heads, head_dim, max_model_len, max_num_seqs, max_num_batched_tokens): Llama 3
# 8B's attention as bench/decode_8b.py serves it, and SmolLM2-135M's.
SERVED_SHAPES = [(32, 8, 128, 8192, 256, 2048), (9, 3, 64, 2048, 64, 512)]
H200_SMS = 132


def _attention_keys(tb, monkeypatch: pytest.MonkeyPatch, shape: tuple,
                    steps: list[tuple[list[int], list[int]]]) -> set[tuple]:
    """The compile keys (`kserve_paged_kernels.launches.variant`) of the attention launches of
    these steps on CUDA, worked out without a GPU: tensors are FakeTensorMode's (shapes on
    `cuda`, no data), the SM count an H200's, and the two kernels record their launches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kserve_paged_kernels.launches import variant

    heads, kv_heads, head_dim, max_model_len, _, _ = shape
    keys: set[tuple] = set()

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs) -> None:
                plain = tuple("tensor" if isinstance(a, torch.Tensor) else a for a in args)
                keys.add(variant(self.kernel, plain, kwargs))
            return launch

    for name in ("_paged_attn_kernel", "_merge_splits_kernel"):
        kernel = getattr(tb, name)
        monkeypatch.setattr(tb, name, Recorder(getattr(kernel, "kernel", kernel)))
    monkeypatch.setattr(tb, "_num_sms", lambda index: H200_SMS)
    width = -(-max_model_len // 16)
    with FakeTensorMode():
        cache = torch.empty(2, 64, 16, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        for q_lens, ctx in steps:
            n, tokens = len(q_lens), sum(q_lens)
            tb.paged_attention_triton(
                torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda"),
                cache, torch.empty(n, width, dtype=torch.int32, device="cuda"),
                torch.empty(n, dtype=torch.int32, device="cuda"),
                torch.empty(n + 1, dtype=torch.int32, device="cuda"), head_dim ** -0.5,
                max_seq_len=max(ctx), max_query_len=max(q_lens))
    return keys


def _serving_steps(max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Decodes of many batch sizes, verifications of 2-5 tokens per sequence and single
    chunks, each over many context lengths (eager steps: their real maxima)."""
    contexts = [c for c in (1, 17, 255, 511, 512, 513, 700, 1024, 1500, 2048, 3000, 4096,
                            6000, 8192) if c <= max_model_len]
    steps = []
    for c in contexts:
        steps += [([1] * b, [c] * b) for b in (1, 2, 3, 5, 8, 13, 16, 24, 32, 48, 64, 100, 128,
                                               200, 256) if b <= max_num_seqs]
        steps += [([q] * b, [c] * b) for q in (2, 3, 5) for b in (1, 2, 4, 8, 16)
                  if q <= c and q * b <= max_num_batched_tokens]
        steps += [([q], [c]) for q in (3, 17, 100, 512, max_num_batched_tokens) if q <= c]
    return steps


@pytest.mark.parametrize("shape", SERVED_SHAPES, ids=["llama3-8b", "smollm2"])
def test_eager_steps_of_any_context_launch_only_the_warm_ups_split_variants(
        triton_interpreter, monkeypatch: pytest.MonkeyPatch, shape: tuple) -> None:
    """On CUDA the attention splits long keys of small grids into a count that depends on the
    step (2..32); that count must not be part of a compile key, or an eager step past the
    warm-up's shapes compiles a new variant while serving. Every compile key of hundreds of
    eager steps' attention launches is one the warm-up's dummy steps launched."""
    tb = triton_interpreter.load("kserve_paged_kernels.triton_backend")
    _, _, _, max_model_len, max_num_seqs, max_num_batched_tokens = shape
    warm = _attention_keys(tb, monkeypatch, shape, warmup_steps(
        max_num_batched_tokens, max_num_seqs, max_model_len))
    served = _attention_keys(tb, monkeypatch, shape, _serving_steps(
        max_model_len, max_num_seqs, max_num_batched_tokens))
    assert len({k[0] for k in served}) == 2  # split steps happened: the merge kernel ran
    assert served - warm == set()
