"""The scheduler's options (EngineConfig.scheduler_config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's share of the engine options (EngineConfig.scheduler_config)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # or "priority"
    max_loras: int = 1  # adapters that may run in one step
    # False for encoders (bidirectional): a prompt is computed whole in one step, or waits.
    chunked_prefill: bool = True
