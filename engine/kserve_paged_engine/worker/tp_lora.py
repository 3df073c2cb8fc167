"""LoRA under tensor parallelism: every rank holds the step's adapters, each its own cut.

Rank 0 loads adapters as at TP = 1 (requests, `/v1/load_lora_adapter`, re-reads after an
eviction: lora/manager.py), checks them and keeps the content it read (`LoRAAdapter.source`).
A step that uses an adapter the workers do not hold yet sends that content in the step's
message, and each worker cuts its own share of it (lora/tp_cut.py): every rank computes from
the same bytes, and no worker reads the adapter's folder (which may have changed since, or
not be mounted on another node). Rank 0 keeps the workers' set bounded like its own
(`max_cpu_loras`): the least recently used adapter beyond it is dropped there by name in the
same message. Each step also carries every sequence's adapter id, from which a worker groups
its rows the way rank 0 did.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.lora.adapter import LoRAAdapter, build_adapter
from kserve_paged_engine.lora.manager import LoRAManager
from kserve_paged_engine.worker.model_runner import StepInputs


class LoRASender:
    """Rank 0: which adapter object each id names on the workers, least recently used first."""

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.capacity = manager.max_cpu_loras
        self._sent: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def message(self, out: SchedulerOutput) -> dict[str, Any] | None:
        """The step's adapter ids, the adapters to install and the ids to drop; None: no
        sequence of this step runs with an adapter. Called after `prepare`, which loaded them."""
        ids = [r.lora_request.lora_int_id if r.lora_request is not None else 0
               for r in out.scheduled]
        if not any(ids):
            return None
        add: dict[int, tuple[str, Any]] = {}
        for lora_id in dict.fromkeys(i for i in ids if i):
            adapter = self.manager.loaded(lora_id)
            assert adapter is not None and adapter.source is not None, "loaded by prepare"
            if self._sent.get(lora_id) is not adapter:  # new, or loaded again since
                add[lora_id] = (adapter.name, adapter.source)
                self._sent[lora_id] = adapter
            self._sent.move_to_end(lora_id)
        drop = []
        while len(self._sent) > self.capacity:  # this step's ids are the most recent
            drop.append(self._sent.popitem(last=False)[0])
        return {"ids": ids, "add": add, "drop": drop}


def receive(manager: LoRAManager, message: dict[str, Any], inputs: StepInputs,
            device: torch.device) -> None:
    """A worker: install and drop what rank 0 says, then group this step's rows."""
    for lora_id in message["drop"]:
        manager.drop(lora_id)
    for lora_id, (name, (cfg, tensors)) in message["add"].items():
        manager.install(lora_id, build_adapter(name, cfg, tensors, manager.model,
                                               manager.max_lora_rank))
    q_lens = torch.diff(inputs.meta.query_start_loc.to(torch.long)).cpu().numpy()
    manager.begin_step_ids(np.asarray(message["ids"], dtype=np.int64), q_lens, device)
