"""What the engine owns to run its steps: the model runner in this process, or (tensor
parallelism, `tp_executor.py`) the runner plus worker processes that run each step on their
shards. Both load the model and execute a scheduled step the same way, so the engine has one
path and the runner knows nothing of other processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.worker.model_runner import ModelRunner, StepResult


class ExecutorError(RuntimeError):
    """The executor can run no further step (a worker died, the ranks fell out of step): fatal
    to the engine, never one request's error."""


class LocalExecutor:
    """The model and its runner in the engine's own process."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None
        # Called (from another thread) when steps can no longer run; never, in one process.
        self.on_death: Callable[[BaseException], None] | None = None

    def load_model(self, path: str, dtype: torch.dtype, device: torch.device,
                   load_format: str = "auto", seed: int = 0,
                   quantization: str | None = None, expert_parallel: bool = False
                   ) -> tuple[Any, Any]:
        """`expert_parallel` changes nothing here: one rank holds every expert."""
        return load_model(path, dtype, device, load_format, seed, quantization=quantization)

    def start(self, runner: ModelRunner, **cache: Any) -> None:
        """Run steps with `runner` (its KV cache is allocated already)."""
        self.runner = runner

    def execute(self, out: SchedulerOutput) -> StepResult:
        assert self.runner is not None, "start() the executor first"
        return self.runner.execute(out)

    def close(self) -> None:
        """Nothing outlives the engine in one process."""
