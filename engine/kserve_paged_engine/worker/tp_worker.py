"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model and of the KV
cache, and a loop that runs whatever rank 0 broadcasts (`tp_executor.py`, `step_wire.py`).

It has no scheduler and no sampler. It exits with its parent (a thread watches the parent's
sentinel), on STOP, or on any error (rank 0's watchdog then sees it go).
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from kserve_paged_engine.distributed.ranks import TPRanks, join_ranks
from kserve_paged_engine.worker import step_wire as wire


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _receive_spec() -> dict[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _report(build: Callable[[], Any]) -> Any:
    """`build()`, its error (if any) gathered to rank 0, which reports it; None when it fails."""
    result, error = None, None
    try:
        result = build()
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it
        error = f"{type(exc).__name__}: {exc}"
    dist.gather_object(error, None, dst=0)
    return result


def worker_main(rank: int, world: int, port: int, device_type: str, threads: int,
                host: str = "127.0.0.1", local_rank: int | None = None) -> None:
    """Rank `rank` of `world`; `host`:`port` is rank 0's store (another pod's address for a
    worker node, engine/kserve_paged_engine/worker/worker_node.py); `local_rank` picks the GPU
    (default: `rank`, every rank in one pod)."""
    device = _enter_process(device_type, threads, rank if local_rank is None else local_rank)
    group = join_ranks(rank, world, port, device, host)
    _Shard(device, group).serve()
    dist.destroy_process_group()


def _enter_process(device_type: str, threads: int, gpu: int) -> torch.device:
    """Settle this process: ignore Ctrl-C, die with the parent, take its threads and device."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 drains and stops us
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    torch.set_num_threads(threads)
    device = torch.device("cuda", gpu) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class _Shard:
    """This rank's model and runner, built and run as rank 0's messages say."""

    def __init__(self, device: torch.device, group: TPRanks) -> None:
        self.device = device
        self.group = group
        self.comm = device if device.type == "cuda" else torch.device("cpu")
        self.model: Any = None
        self.runner: Any = None

    def serve(self) -> None:
        """Run rank 0's messages until STOP."""
        # The loader's imports (transformers) now, while rank 0 is still busy, not at the first LOAD.
        import kserve_paged_engine.lora
        import kserve_paged_engine.model_executor.model_loader
        import kserve_paged_engine.worker.model_runner
        import kserve_paged_engine.worker.tp_extras  # noqa: F401
        head = torch.empty(wire.HEADER_LEN, dtype=torch.long, device=self.comm)
        while True:
            dist.broadcast(head, 0)
            fields = head.tolist()
            command = fields[0]
            if command == wire.STEP:
                self.step(fields)
            elif command == wire.LOAD:
                self.model = self.runner = None
                self.model = _report(partial(self.load, _receive_spec()))
            elif command == wire.CACHE:
                self.runner = _report(partial(self.build_runner, _receive_spec()))
            elif command == wire.RELEASE:
                self.model = self.runner = None
                gc.collect()
            elif command == wire.STOP:
                return

    def step(self, fields: list[int]) -> None:
        from kserve_paged_engine.worker.tp_extras import worker_receive

        payload = torch.empty(wire.payload_len(fields), dtype=torch.long, device=self.comm)
        dist.broadcast(payload, 0)
        inputs, copies = wire.unpack(fields, payload, self.device, self.runner.attention_backend)
        with torch.inference_mode():
            if fields[wire.EXTRA]:  # LoRA adapters, KV-tier copies (tp_extras.py)
                worker_receive(self.runner, inputs, self.device)
            self.runner.forward(inputs, copies)

    def load(self, spec: dict[str, Any]) -> Any:
        """This rank's shard of the weights (LOAD's spec: TPExecutor.load_model)."""
        from kserve_paged_engine.model_executor.model_loader import load_model

        model, _ = load_model(spec["path"], spec["dtype"], self.device, spec["load_format"],
                              spec["seed"], tp=self.group,
                              quantization=spec.get("quantization"),
                              expert_parallel=spec.get("expert_parallel", False))
        return model

    def build_runner(self, spec: dict[str, Any]) -> Any:
        """This rank's runner and share of the KV cache (CACHE's spec: TPExecutor.start)."""
        from kserve_paged_engine.lora import LoRAManager
        from kserve_paged_engine.worker.model_runner import ModelRunner

        lora = None if spec.get("lora") is None else LoRAManager(self.model, **spec["lora"])
        return ModelRunner(self.model, None, spec["num_blocks"], spec["block_size"],
                           spec["dtype"], self.device,
                           max_num_batched_tokens=spec["max_num_batched_tokens"],
                           max_num_seqs=spec["max_num_seqs"],
                           max_model_len=spec["max_model_len"],
                           kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                           layout=spec.get("layout"),
                           lora=lora)
