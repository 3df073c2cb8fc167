"""Every step's sampling logits of an engine, recorded as it runs: the TP tests compare them
with TP = 1's step by step."""

from __future__ import annotations

import torch


def record_step_logits(engine) -> list[torch.Tensor]:
    """A list that fills with a copy of each executed step's logits from now on."""
    steps: list[torch.Tensor] = []
    execute = engine.executor.execute

    def recording(out):
        result = execute(out)
        steps.append(result.logits.clone())
        return result

    engine.executor.execute = recording
    return steps
