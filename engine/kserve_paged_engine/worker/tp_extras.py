"""What a tensor-parallel step carries beside its inputs, when it has any: LoRA adapters
(worker/tp_lora.py) and the second KV tier's block copies (worker/tp_tier.py).

Rank 0 builds one message per step that has either, flags it in the step's header
(`step_wire.EXTRA`) and broadcasts it as an object after the payload; then the tier's
gather/scatter run on every rank, before the forward. Steps without either cost nothing more.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.worker.model_runner import ModelRunner, StepInputs
from kserve_paged_engine.worker.tp_lora import LoRASender, receive
from kserve_paged_engine.worker.tp_tier import rank0_moves, rank_row_bytes, worker_moves


class StepExtras:
    """Rank 0's side, for one engine's runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.lora = LoRASender(runner.lora) if runner.lora is not None else None
        tier = runner.tier
        if tier is not None and not isinstance(tier, DiskTier):
            raise ValueError("only the disk KV tier is built under tensor parallelism")
        self.tier = tier
        self.sizes = rank_row_bytes(runner.slot_caches, runner.model) if tier is not None else []

    def message(self, out: SchedulerOutput) -> dict[str, Any] | None:
        msg: dict[str, Any] = {}
        lora = self.lora.message(out) if self.lora is not None else None
        if lora is not None:
            msg["lora"] = lora
        moves = out.tier_moves if self.tier is not None else None
        if moves:
            msg["tier"] = ([b for b, _ in moves.saves], [b for b, _ in moves.loads])
        return msg or None

    def send(self, out: SchedulerOutput, msg: dict[str, Any]) -> None:
        """After the step's header and payload: the message, then the tier's copies."""
        dist.broadcast_object_list([msg], 0)
        if "tier" in msg:
            assert self.tier is not None and out.tier_moves is not None
            rank0_moves(self.runner.slot_caches, out.tier_moves, self.tier, self.sizes)


def worker_receive(runner: ModelRunner, inputs: StepInputs, device: torch.device) -> None:
    """A worker's side of `StepExtras.send`."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0)
    msg = box[0]
    if "lora" in msg:
        assert runner.lora is not None, "rank 0 sends adapters only with LoRA on"
        receive(runner.lora, msg["lora"], inputs, device)
    if "tier" in msg:
        worker_moves(runner.slot_caches, *msg["tier"])
