"""The loaded adapters (an LRU of at most `max_cpu_loras`) and their hooks into the model.

Forward hooks on each adapted projection add the step's LoRA delta to the base output, so the
model code stays as it is. With LoRA on, the native whole-stack CPU call and the fused
gate/up+SiLU GEMM are turned off: they skip the per-projection modules the hooks live on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kserve_paged_engine.lora.adapter import TARGETS, LoRAAdapter, load_adapter, open_folder
from kserve_paged_engine.lora.batch import (
    LoRAStep,
    SlotStacks,
    add_lora_delta,
    group_rows,
    sgmv_step,
)
from kserve_paged_engine.lora.folder import AdapterFolder
from kserve_paged_engine.lora.request import LoRARequest
from kserve_paged_kernels import cpu_native

MODULES = tuple(dict.fromkeys(module for module, _ in TARGETS.values()))
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # partial sums under tensor parallelism


def _as_keyed(lora: LoRARequest, adapter: LoRAAdapter) -> LoRAAdapter:
    """`adapter`, if its content is what the request's blocks are keyed by (its digest, set
    at admission): files rewritten since, read again after an eviction, must not compute
    blocks under the old content's key (lora/digest.py); ValueError then."""
    if lora.content_digest is not None and lora.content_digest != adapter.digest:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: its files changed since this "
                         "request was admitted; send the request again")
    return adapter


class LoRAManager:
    def __init__(self, model: Any, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = next(model.parameters()).dtype
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._known: dict[int, LoRARequest] = {}
        # Each known adapter's folder, opened at its first load and read through at every
        # re-read after an eviction (lora/folder.py): a path swapped later is never followed.
        self._folders: dict[int, AdapterFolder] = {}
        self._step: LoRAStep | None = None
        # Stacked slots per adapter mix for the one-call kernels (`_stacks_for`).
        self._stack_cache: OrderedDict[tuple[int, ...], SlotStacks] = OrderedDict()
        self._install()

    def _install(self) -> None:
        self.model.use_native_stack = False
        for i, layer in enumerate(self.model.model.layers):
            mlp = layer.mlp
            if getattr(mlp, "_fused", None) is not None:
                mlp._fused = mlp._fused_bias = None
                mlp.gate_up_proj.fused_by_owner = False  # its plain pack is the one kept now
                mlp.gate_up_proj.pack()
            for module in MODULES:
                linear = layer.get_submodule(module)
                if hasattr(linear, "partial_hook"):  # row-parallel: before its all-reduce
                    linear.partial_hook = self._partial((i, module))
                elif getattr(self.model, "tp", None) is not None and module in ROW_PARALLEL:
                    raise ValueError(f"LoRA under tensor parallelism: {module} "
                                     f"({type(linear).__name__}) takes no delta before its "
                                     "all-reduce")
                else:
                    linear.register_forward_hook(self._hook((i, module)))

    def _partial(self, key: tuple[int, str]):
        def add(x: torch.Tensor, out: torch.Tensor) -> None:
            step = self._step
            if step is not None and x.dim() == 2:
                add_lora_delta(x, out, step, key)
        return add

    def _hook(self, key: tuple[int, str]):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                 out: torch.Tensor) -> torch.Tensor | None:
            step = self._step
            if step is None or args[0].dim() != 2:
                return None
            add_lora_delta(args[0], out, step, key)
            return out
        return hook

    # ------------------------------------------------------------ adapters
    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """Load (or touch) an adapter; ValueError if it is bad or its id names another one."""
        known = self._known.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by adapter "
                             f"{known.lora_name!r} ({known.lora_path})")
        adapter = self._loaded.get(lora.lora_int_id)
        if adapter is not None:
            self._loaded.move_to_end(lora.lora_int_id)
            return _as_keyed(lora, adapter)
        folder = self._folders.get(lora.lora_int_id)
        if folder is None:
            folder = open_folder(lora.lora_name, lora.lora_path, lora.lora_roots)
            try:
                adapter = load_adapter(lora.lora_name, folder, self.model, self.max_lora_rank)
            except BaseException:
                folder.close()
                raise
            self._folders[lora.lora_int_id] = folder
        else:  # evicted earlier: read again through the folder opened at the first load
            adapter = load_adapter(lora.lora_name, folder, self.model, self.max_lora_rank)
        self._known[lora.lora_int_id] = lora
        self._loaded[lora.lora_int_id] = adapter
        self._evict(keep=set())
        return _as_keyed(lora, adapter)

    def _evict(self, keep: set[int]) -> None:
        for lora_id in list(self._loaded):
            if len(self._loaded) <= self.max_cpu_loras:
                return
            if lora_id not in keep and lora_id != next(reversed(self._loaded)):
                del self._loaded[lora_id]
                self._stack_cache.clear()

    def remove(self, lora_int_id: int) -> bool:
        self._known.pop(lora_int_id, None)
        folder = self._folders.pop(lora_int_id, None)
        if folder is not None:
            folder.close()
        self._stack_cache.clear()
        return self._loaded.pop(lora_int_id, None) is not None

    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    def loaded(self, lora_int_id: int) -> LoRAAdapter | None:
        return self._loaded.get(lora_int_id)

    def install(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        """A tensor-parallel worker's side: the adapter rank 0 sent (worker/tp_lora.py)."""
        self._loaded[lora_int_id] = adapter
        self._stack_cache.clear()

    def drop(self, lora_int_id: int) -> None:
        if self._loaded.pop(lora_int_id, None) is not None:
            self._stack_cache.clear()

    # ------------------------------------------------------------ steps
    def begin_step(self, loras: Sequence[LoRARequest | None], q_lens: np.ndarray,
                   device: torch.device) -> None:
        """Group the step's rows by adapter (the runner calls this with each sequence's
        adapter and scheduled token count); an evicted adapter is loaded again here."""
        ids = np.array([lora.lora_int_id if lora is not None else 0 for lora in loras],
                       dtype=np.int64)
        rows, runs = group_rows(np.repeat(ids, q_lens))
        if not runs:
            self._step = None
            return
        if len(runs) > self.max_loras:
            raise RuntimeError(f"{len(runs)} adapters in one step exceed max_loras "
                               f"{self.max_loras}")
        by_id = {lora.lora_int_id: lora for lora in loras if lora is not None}
        adapters = {lora_id: self.add(by_id[lora_id]) for lora_id, _, _ in runs}
        self._evict(keep=set(adapters))
        self._start(rows, runs, adapters, device)

    def begin_step_ids(self, ids: np.ndarray, q_lens: np.ndarray, device: torch.device
                       ) -> None:
        """`begin_step` on a tensor-parallel worker: each sequence's adapter id (0: none),
        every adapter installed already by rank 0."""
        rows, runs = group_rows(np.repeat(ids, q_lens))
        if not runs:
            self._step = None
            return
        self._start(rows, runs, {i: self._loaded[i] for i, _, _ in runs}, device)

    def _start(self, rows: np.ndarray, runs: list[tuple[int, int, int]],
               adapters: dict[int, LoRAAdapter], device: torch.device) -> None:
        segments = [(adapters[lora_id], start, end) for lora_id, start, end in runs]
        step = LoRAStep(torch.from_numpy(rows).to(device), segments)
        backend = self._backend(device)
        if backend is not None:
            mix = tuple(a for a, _, _ in segments)
            step.sgmv = sgmv_step(segments, self._stacks_for(mix, backend == "native"),
                                  device, backend)
        self._step = step

    def _backend(self, device: torch.device) -> str | None:
        """The one-call kernel for this step's delta: Triton on CUDA, the native library for
        fp32 on CPU; None: per-adapter torch matmuls."""
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu" and self.dtype == torch.float32 and cpu_native.load() is not None:
            return "native"
        return None

    def _stacks_for(self, adapters: tuple[LoRAAdapter, ...], rank_major: bool) -> SlotStacks:
        """Stacked slots of this adapter tuple, kept for the next steps with the same mix
        (a few mixes at most; an adapter loaded again is a new object, so a new entry)."""
        key = tuple(id(a) for a in adapters)
        stacks = self._stack_cache.pop(key, None) or SlotStacks(adapters, rank_major)
        self._stack_cache[key] = stacks
        while len(self._stack_cache) > 4:
            self._stack_cache.pop(next(iter(self._stack_cache)))
        return stacks

    def end_step(self) -> None:
        self._step = None
