"""The tensor-parallel executor, rank 0's side: start the worker processes, load and size
them, send each step, notice when one dies, stop them.

The engine (scheduler, KV-cache manager, sampler) lives on rank 0 only. Workers
(`engine/kserve_paged_engine/worker/tp_worker.py`) hold their shard of the weights and of the paged KV cache
(the same block ids, their own KV heads) and wait for the next broadcast. Every message is a
header broadcast (`step_wire.py`); LOAD and CACHE carry one pickled dict more and end with a
gather of each rank's error, if any, so a worker that cannot load fails start-up with its
reason.

A worker that dies or a step that fails is `TPWorkerError`, fatal to the engine: the watch
over the workers (`tp_watchdog.py`) notices it, records why and tells the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from kserve_paged_engine.config.multi_node import NodeLayout
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.distributed.ranks import (
    COLLECTIVE_TIMEOUT,
    START_TIMEOUT,
    TPRanks,
    backend_for,
    joined_key,
)
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.tp_load import check_tensor_parallel_folder
from kserve_paged_engine.worker import step_wire as wire
from kserve_paged_engine.worker.model_runner import ModelRunner, StepResult, step_result
from kserve_paged_engine.worker.tp_extras import StepExtras
from kserve_paged_engine.worker.tp_watchdog import TPWorkerError, WorkerWatch

logger = logging.getLogger("kserve_paged_engine")

STOP_GRACE_S = 5.0


class TPExecutor:
    """The N-1 worker processes of one engine, the process group they share with it, and rank
    0's runner."""

    # A pool kept across engines (tests, benchmarks): `acquire` hands it out when it fits.
    _kept: ClassVar[TPExecutor | None] = None

    def __init__(self, world_size: int, device: torch.device,
                 nodes: NodeLayout | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this "
                               "process; one tensor-parallel engine per process")
        if nodes is not None and not nodes.is_leader:
            raise ValueError(f"node_rank {nodes.node_rank} is a worker node: it runs "
                             "worker_node.run_worker_node, not an engine")
        # Several pods (config/multi_node.py): this pod runs ranks 0..local-1 and hosts the
        # store at nodes.master_port; the worker nodes run the rest and join over the network.
        local = world_size if nodes is None else nodes.ranks_per_node(world_size)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(f"tensor_parallel_size {world_size} needs {local} GPUs in this "
                             f"pod; {torch.cuda.device_count()} visible")
        self.world_size = world_size
        self.nodes = nodes
        self.device = device
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self.in_use = False
        self.runner: ModelRunner | None = None
        self.extras: StepExtras | None = None  # LoRA and KV-tier messages (tp_extras.py)
        self._threads = torch.get_num_threads()
        # On CPU the ranks share the cores: each takes its part (TP = 2 on 2 cores: 1 each).
        threads = max(1, self._threads // local)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        # The store listens on every interface: worker nodes reach it at the leader's address.
        store = dist.TCPStore("127.0.0.1", 0 if nodes is None else nodes.master_port,
                              world_size, is_master=True, timeout=START_TIMEOUT,
                              wait_for_workers=False)
        from kserve_paged_engine.worker.tp_worker import worker_main

        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, name=f"kserve-paged-tp{rank}",
                                  args=(rank, world_size, store.port, device.type, threads),
                                  daemon=True)
                      for rank in range(1, local)]
        for p in self.procs:
            p.start()
        self.watch = WorkerWatch(self.procs, device)
        self._wait_joined(store)
        dist.init_process_group(backend_for(device), store=store, rank=0,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        self.group = TPRanks(0, world_size)
        if nodes is not None and nodes.nnodes > 1:
            remote = {n: f"{n * local}..{n * local + local - 1}" for n in range(1, nodes.nnodes)}
            self.watch.watch_nodes(store.port, remote)
        logger.info("tensor parallelism: %d ranks (%s) on %d node(s), local worker pids %s",
                    world_size, backend_for(device), 1 if nodes is None else nodes.nnodes,
                    [p.pid for p in self.procs])

    @property
    def failure(self) -> str | None:
        """Why the group cannot go on (`tp_watchdog.py`), or None."""
        return self.watch.failure

    @property
    def on_death(self) -> Callable[[BaseException], None] | None:
        return self.watch.on_death

    @on_death.setter
    def on_death(self, callback: Callable[[BaseException], None] | None) -> None:
        self.watch.on_death = callback

    # -- engines ------------------------------------------------------------------------------

    @classmethod
    def acquire(cls, world_size: int, device: torch.device,
                nodes: NodeLayout | None = None) -> TPExecutor:
        """Workers for a new engine: the kept pool when it fits and is free, else new ones."""
        kept = cls._kept
        if (kept is not None and kept.world_size == world_size and kept.device == device
                and kept.nodes == nodes and not kept.in_use and kept.failure is None):
            kept.in_use = True
            return kept
        workers = cls(world_size, device, nodes)
        workers.in_use = True
        return workers

    def keep(self) -> TPExecutor:
        """Keep these workers alive across engines (`close` then only releases the model)."""
        TPExecutor._kept = self
        return self

    def close(self) -> None:
        """The engine is done with them: drop the model (kept pool) or stop them."""
        self.runner = self.extras = None
        if TPExecutor._kept is self and self.failure is None and not self.watch.stopping:
            self._send(wire.RELEASE)
            self.on_death = None
            self.in_use = False
        else:
            self.stop()

    def load_model(self, path: str, dtype: torch.dtype, device: torch.device,
                   load_format: str = "auto", seed: int = 0,
                   quantization: str | None = None, expert_parallel: bool = False
                   ) -> tuple[Any, Any]:
        """Every rank loads its shard at once; rank 0's (model, config), or the first error.
        `expert_parallel`: a mixture of experts' experts spread over the ranks, not cut.
        `quantization`: each rank cuts the quantized weights in their packed form."""
        try:  # a model that cannot shard is refused before any rank loads it
            check_tensor_parallel_folder(path, self.world_size, expert_parallel)
        except ValueError:
            self.close()
            raise
        self._send(wire.LOAD, spec={"path": path, "dtype": dtype, "load_format": load_format,
                                    "seed": seed, "expert_parallel": expert_parallel,
                                    "quantization": quantization})
        result, error = None, None
        try:
            result = load_model(path, dtype, device, load_format, seed, tp=self.group,
                                quantization=quantization, expert_parallel=expert_parallel)
        except Exception as exc:  # noqa: BLE001 - reported after the workers report theirs
            error = exc
        self._gather_errors(error, "loading the model")
        assert result is not None
        return result

    def start(self, runner: ModelRunner, **cache: Any) -> None:
        """Run steps with rank 0's `runner`; each worker builds its own: its share of the KV
        cache, the same number of blocks (`cache`: the runner's sizes), in the runner's KV
        cache dtype, with LoRA slots when it has them (worker/tp_extras.py)."""
        self.extras = StepExtras(runner)
        lora = runner.lora
        cache.update(kv_cache_dtype=runner.kv_cache_dtype, layout=runner.layout,
                     lora=None if lora is None else {
            "max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank,
            "max_cpu_loras": lora.max_cpu_loras})
        self._send(wire.CACHE, spec=cache)
        self._gather_errors(None, "allocating the KV cache")
        self.runner = runner

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Prepare the step on rank 0, broadcast it, run rank 0's share; logits gathered here."""
        assert self.runner is not None, "start() the executor first"
        inputs = self.runner.prepare(out)
        self.check_alive()
        try:
            head, payload = wire.pack(inputs, out.block_copies, self.comm_device)
            extra = self.extras.message(out) if self.extras is not None else None
            if extra is not None:
                head[wire.EXTRA] = 1
            dist.broadcast(head, 0)
            dist.broadcast(payload, 0)
            if extra is not None:
                self.extras.send(out, extra)
            outs = self.runner.forward(inputs, out.block_copies)
        except Exception as exc:
            raise self.watch.fatal(exc) from exc
        return step_result(inputs, outs, self.runner.device)

    def check_alive(self) -> None:
        self.watch.check_alive()

    # -- internals ----------------------------------------------------------------------------

    def _wait_joined(self, store: dist.TCPStore) -> None:
        """Until every worker is about to join the group (each sets a key first): a worker
        that dies on the way fails start-up at once, not after the group's timeout."""
        keys = [joined_key(rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not store.check(keys):
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                for p in self.procs:
                    p.terminate()
                self.watch.stop()
                if self.device.type == "cpu":
                    torch.set_num_threads(self._threads)
                what = (f"exited with code {dead[0].exitcode}" if dead
                        else f"did not start in {START_TIMEOUT.total_seconds():.0f} s")
                where = ("" if self.nodes is None else
                         f"; worker nodes join at port {self.nodes.master_port} of this pod")
                raise TPWorkerError(f"a tensor-parallel worker {what} before joining the "
                                    f"group (its log is above{where})")
            time.sleep(0.05)

    def _send(self, command: int, spec: dict[str, Any] | None = None) -> None:
        dist.broadcast(wire.header(command, device=self.comm_device), 0)
        if spec is not None:
            dist.broadcast_object_list([spec], 0)

    def _gather_errors(self, error: BaseException | None, what: str) -> None:
        errors: list[str | None] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.gather_object(mine, errors, dst=0)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        self.close()  # every rank answered: still in step, a kept pool stays usable
        if error is not None:
            raise error
        rank, message = failed[0]
        raise TPWorkerError(f"tensor-parallel rank {rank} failed {what}: {message}")

    def stop(self) -> None:
        """Stop the workers (STOP when they can hear it, else terminate) and the group."""
        if self.watch.stopping:
            return
        self.watch.stop()
        if self.failure is None:
            try:
                self._send(wire.STOP)
            except Exception:  # noqa: BLE001 - a broken group: terminate below
                logger.warning("tensor-parallel workers did not take STOP; terminating them")
        for p in self.procs:
            p.join(STOP_GRACE_S)
            if p.exitcode is None:
                p.terminate()
                p.join(STOP_GRACE_S)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already broken by a dead peer
                logger.debug("destroy_process_group failed", exc_info=True)
        if self.device.type == "cpu":
            torch.set_num_threads(self._threads)
        if TPExecutor._kept is self:
            TPExecutor._kept = None
        self.in_use = False
