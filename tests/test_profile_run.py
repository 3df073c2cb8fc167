"""KV sizing by a profile run (issue 32, item 5): the arithmetic with stubbed memory figures,
and the largest step a profile runs, on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kserve_paged_engine.worker.profile_run import MemoryProfile, largest_step, profile_memory

GiB = 1 << 30


class StubMemory:
    """torch.cuda's memory calls with set figures; the step allocates `step_peak` bytes."""

    def __init__(self, total: int, weights: int, step_peak: int, context: int) -> None:
        self.total, self.weights, self.step_peak, self.context = total, weights, step_peak, context
        self.calls: list[str] = []
        self.peak = weights

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.weights

    def run(self) -> None:
        self.calls.append("step")
        self.peak = self.weights + self.step_peak

    def synchronize(self) -> None:
        self.calls.append("sync")

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.peak + 64 << 20  # the allocator keeps a little more than its peak

    def mem_get_info(self) -> tuple[int, int]:
        used = self.memory_reserved() + self.context
        return self.total - used, self.total


def test_budget_is_utilization_times_total_minus_the_non_kv_peak() -> None:
    mem = StubMemory(total=141 * GiB, weights=16 * GiB, step_peak=3 * GiB, context=GiB // 2)
    prof = profile_memory(mem.run, mem)
    assert mem.calls == ["empty_cache", "reset", "step", "sync"]
    assert prof.torch_peak == 19 * GiB and prof.non_torch == GiB // 2
    assert prof.non_kv_peak == 19 * GiB + GiB // 2
    assert prof.kv_budget(0.9) == int(0.9 * 141 * GiB) - (19 * GiB + GiB // 2)
    assert prof.kv_budget(0.1) == 0  # the step alone is past the share: nothing, not < 0


def test_the_peak_is_the_steps_not_an_earlier_one() -> None:
    mem = StubMemory(total=80 * GiB, weights=10 * GiB, step_peak=2 * GiB, context=0)
    mem.peak = 70 * GiB  # an earlier spike (loading) the reset forgets
    assert profile_memory(mem.run, mem).torch_peak == 12 * GiB


def test_explicit_kv_cache_memory_wins_over_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA without an explicit size the profile's budget sizes the cache; with
    kv_cache_memory (or num_kv_blocks) set, no profile runs."""
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend import startup

    profiled: list[int] = []
    monkeypatch.setattr(startup, "profiled_kv_memory",
                        lambda *a: profiled.append(1) or 64 * 4096)
    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16, layer_windows=[None] * 2)
    monkeypatch.setattr(startup.ModelFacts, "of", staticmethod(lambda m: m))
    cuda = torch.device("cuda")
    size = startup.size_cache(EngineConfig(model="x"), model, None, torch.float32, cuda)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # K and V, layers, heads, dim, fp32, block of 16
    assert profiled == [1] and size.num_blocks == 64 * 4096 // per_block
    size = startup.size_cache(EngineConfig(model="x", kv_cache_memory=per_block * 5), model,
                              None, torch.float32, cuda)
    assert profiled == [1] and size.num_blocks == 5
    monkeypatch.setattr(startup, "profiled_kv_memory", lambda *a: 0)
    with pytest.raises(ValueError, match="no device memory"):
        startup.size_cache(EngineConfig(model="x"), model, None, torch.float32, cuda)


def test_the_largest_step_runs_a_model_without_storing() -> None:
    from transformers import LlamaConfig

    from kserve_paged_engine.model_executor.models import LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=64))
    seen = []
    real = model.compute_logits
    model.compute_logits = lambda h: seen.append(h.shape[0]) or real(h)
    largest_step(model, torch.float32, torch.device("cpu"), num_tokens=40, num_rows=8,
                 block_size=16)()
    assert seen == [8]


def test_memory_profile_reads_as_bytes() -> None:
    assert MemoryProfile(total=100, torch_peak=30, non_torch=5).kv_budget(0.5) == 15
