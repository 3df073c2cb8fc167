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
from typing import Any

import torch
import torch.distributed as dist

from kserve_paged_engine.distributed.ranks import join_ranks
from kserve_paged_engine.worker import step_wire as wire


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _receive_spec() -> dict[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def worker_main(rank: int, world: int, port: int, device_type: str, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 drains and stops us
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = join_ranks(rank, world, port, device)
    # The loader's imports (transformers) now, while rank 0 is still busy, not at the first LOAD.
    from kserve_paged_engine.model_executor.model_loader import load_model
    from kserve_paged_engine.worker.model_runner import ModelRunner
    comm = device if device.type == "cuda" else torch.device("cpu")
    head = torch.empty(wire.HEADER_LEN, dtype=torch.long, device=comm)
    model: Any = None
    runner: Any = None
    while True:
        dist.broadcast(head, 0)
        fields = head.tolist()
        command = fields[0]
        if command == wire.STEP:
            payload = torch.empty(wire.payload_len(fields), dtype=torch.long, device=comm)
            dist.broadcast(payload, 0)
            inputs, copies = wire.unpack(fields, payload, device, runner.attention_backend)
            with torch.inference_mode():
                runner.forward(inputs, copies)
        elif command == wire.LOAD:
            spec = _receive_spec()
            model, runner = None, None
            error = None
            try:
                model, _ = load_model(spec["path"], spec["dtype"], device, spec["load_format"],
                                      spec["seed"], tp=group)
            except Exception as exc:  # noqa: BLE001 - rank 0 reports it
                error = f"{type(exc).__name__}: {exc}"
            dist.gather_object(error, None, dst=0)
        elif command == wire.CACHE:
            spec = _receive_spec()
            error = None
            try:
                runner = ModelRunner(model, None, spec["num_blocks"], spec["block_size"],
                                     spec["dtype"], device,
                                     max_num_batched_tokens=spec["max_num_batched_tokens"],
                                     max_num_seqs=spec["max_num_seqs"],
                                     max_model_len=spec["max_model_len"])
            except Exception as exc:  # noqa: BLE001 - rank 0 reports it
                error = f"{type(exc).__name__}: {exc}"
            dist.gather_object(error, None, dst=0)
        elif command == wire.RELEASE:
            model, runner = None, None
            gc.collect()
        elif command == wire.STOP:
            break
    dist.destroy_process_group()
