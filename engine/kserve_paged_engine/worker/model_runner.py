"""Turns one scheduler step into flat tensors, runs the model once, returns sampling logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import kserve_paged_kernels as kernels
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.kv_groups import KVLayout, kv_layout
from kserve_paged_engine.core.kv_sizing import kv_bytes_per_block
from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HostTier
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.lora import LoRAManager
from kserve_paged_engine.model_executor.attention import (
    Attention,
    AttentionMetadata,
    GroupedMetadata,
)
from kserve_paged_engine.model_executor.host_io import upload
from kserve_paged_engine.worker.cpu_memory import (
    hugepage_zeros,
    prefault_bytes,
)
from kserve_paged_engine.worker.cuda_graphs import DecodeGraphs, capture_sizes, why_eager
from kserve_paged_engine.worker.kv_prefault import KVPrefault
from kserve_paged_engine.worker.kv_tier_copy import apply_tier_moves
from kserve_paged_kernels.kv_quant import QuantKV, storage_dtype


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Requests whose scheduled tokens reach their end, in logits-row order.
    sampling: list[Request]
    # Requests asking for prompt logprobs: (request, first prompt position, count) and the
    # flat rows of those positions (position p's logits score prompt token p + 1).
    prompt_spans: list[tuple[Request, int, int]]
    prompt_rows: list[int]
    # Pooling requests: (request, first prompt position, count) and the flat rows whose hidden
    # states they pool (engine/kserve_paged_engine/frontend/pooling.py).
    pool_spans: list[tuple[Request, int, int]] = field(default_factory=list)
    pool_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    # float32 [rows, vocab]: one row per sampling request, 1 + its drafts when it has drafts
    logits: torch.Tensor
    sampling: list[Request]
    prompt_logits: torch.Tensor | None  # float32 [len(prompt_rows), vocab]
    prompt_spans: list[tuple[Request, int, int]]
    pool_hidden: torch.Tensor | None = None  # [len(pool_rows), hidden] final hidden states
    pool_spans: list[tuple[Request, int, int]] = field(default_factory=list)


def step_result(inputs: StepInputs, outs: tuple[torch.Tensor | None, ...],
                device: torch.device) -> StepResult:
    """A forward's (prompt logits, logits, pooled rows) as the engine reads them (no
    sampling rows: an empty tensor)."""
    prompt_logits, logits, pool_hidden = outs
    if logits is None:
        logits = torch.empty((0, 0), dtype=torch.float32, device=device)
    return StepResult(logits, inputs.sampling, prompt_logits, inputs.prompt_spans,
                      pool_hidden, inputs.pool_spans)


class _StepBuffers:
    """Host tensors sized for the largest step, filled through numpy views every step.

    On a GPU the same shapes live on the device too and each step copies only the used prefix.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device, num_groups: int = 1) -> None:
        pin = device.type == "cuda"

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.device = device
        self.input_ids = host(max_tokens, torch.long)
        self.positions = host(max_tokens, torch.long)
        self.slot_mapping = host(max_tokens, torch.long)
        self.block_tables = host(max_seqs * max_blocks, torch.int32)
        self.seq_lens = host(max_seqs, torch.int32)
        self.query_start_loc = host(max_seqs + 1, torch.int32)
        self.logits_indices = host(max(max_seqs, max_tokens), torch.long)  # + draft rows
        self.row_lens = host(max_tokens, torch.int32)
        self.row_seq_idx = host(max_tokens, torch.long)
        names = ["input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "logits_indices", "row_lens", "row_seq_idx"]
        for g in range(1, num_groups):  # each further KV group's own tables and slots
            setattr(self, f"slot_mapping{g}", host(max_tokens, torch.long))
            setattr(self, f"block_tables{g}", host(max_seqs * max_blocks, torch.int32))
            names += [f"slot_mapping{g}", f"block_tables{g}"]
        self._names = tuple(names)
        self.np = {n: getattr(self, n).numpy() for n in self._names}
        self.dev = ({n: torch.zeros_like(getattr(self, n), device=device) for n in self._names}
                    if device.type != "cpu" else None)
        # Marks when the last step's host-to-device copies were done reading the host buffers.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def wait_until_free(self) -> None:
        """Block until the previous step's non-blocking copies have read the host buffers, so
        refilling them cannot race with a copy still queued on the GPU."""
        if self._copied is not None:
            self._copied.synchronize()

    def mark_copied(self) -> None:
        if self._copied is not None:
            self._copied.record()

    def take(self, name: str, n: int) -> torch.Tensor:
        """The first n entries, on the model's device."""
        host = getattr(self, name)[:n]
        if self.dev is None:
            return host
        return self.dev[name][:n].copy_(host, non_blocking=True)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slots: int,
              codes: torch.dtype | None) -> tuple[list[Any], KVPrefault | None]:
    """One zeroed cache per slot: tensors of `dtype`, or with `codes` (a quantized
    --kv-cache-dtype) `QuantKV`s of codes and scales; and, on CPU, the prefault making the
    leading blocks resident (worker/kv_prefault.py). On CPU in huge pages (decode reads
    blocks at random offsets)."""
    if device.type != "cpu":
        if codes is not None:
            return [QuantKV.zeros(shape, codes, device) for _ in range(slots)], None
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(slots)], None
    if codes is not None:
        caches = [QuantKV.zeros(shape, codes, alloc=hugepage_zeros) for _ in range(slots)]
        tensors = [c.data for c in caches]
    else:
        caches = tensors = [hugepage_zeros(shape, dtype) for _ in range(slots)]
    elem = tensors[0].dtype.itemsize
    per_block = kv_bytes_per_block(slots, shape[3], shape[4], shape[2], elem)
    return caches, KVPrefault(tensors, min(shape[1], prefault_bytes() // per_block))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | None, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 layout: KVLayout | None = None, kv_cache_dtype: str = "auto",
                 lora: LoRAManager | None = None, tier: DiskTier | HostTier | None = None
                 ) -> None:
        """`layout`: how layers share blocks (engine/kserve_paged_engine/core/kv_groups.py); None: one group of every
        layer (one tensor per layer, one block table per request). `kv_cache_dtype`: a
        quantized one (kernels/kserve_paged_kernels/kv_formats.py) makes each slot a `QuantKV`. `lora`: the adapters'
        manager when LoRA is on; `tier`: the second KV tier when one is on."""
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.layout = layout or kv_layout([None] * model.num_layers, per_group=False)
        if len(self.layout.layer_group) != model.num_layers:
            raise ValueError(f"KV layout for {len(self.layout.layer_group)} layers, the model "
                             f"has {model.num_layers}")
        attns = ([m for m in model.modules() if isinstance(m, Attention)]
                 if isinstance(model, torch.nn.Module) else [])
        if self.layout.num_groups > 1 and len(attns) != model.num_layers:
            raise ValueError(f"{len(attns)} attention layers for {model.num_layers} layers: "
                             "cannot give each its KV group")
        for attn, group in zip(attns, self.layout.layer_group):
            attn.kv_group = group
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # One tensor per slot (engine/kserve_paged_engine/core/kv_groups.py); layer i reads slot `layer_slot[i]` through
        # its group's tables. Zeros, not empty: a partly filled last block is read (and
        # masked); NaN garbage there would still poison the softmax.
        self.kv_cache_dtype = kv_cache_dtype
        self.slot_caches, self.prefault = _allocate(shape, dtype, device,
                                                    self.layout.group_size,
                                                    storage_dtype(kv_cache_dtype))
        self.kv_caches = [self.slot_caches[s] for s in self.layout.layer_slot]
        # The one choice of attention backend for every step (the native decoder stack is the
        # CPU backend's whole-step form; the model takes it when this says "cpu").
        self.attention_backend = kernels.resolve_backend(
            device, block_size=block_size, head_dim=model.head_dim, dtype=dtype)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buffers = _StepBuffers(max_num_batched_tokens, max_num_seqs,
                                    self.max_blocks_per_seq, device, self.layout.num_groups)
        self.lora = lora
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None  # captured decode steps (capture_graphs)
        self.tier = tier

    def capture_graphs(self, max_num_seqs: int, capturer: Any) -> str | None:
        """Capture the decode graphs (engine/kserve_paged_engine/worker/cuda_graphs.py) over the sized cache;
        returns why not when this runner cannot use them."""
        why = why_eager(self.model, self.device, num_groups=self.layout.num_groups,
                        lora=self.lora is not None,
                        quantized_kv=isinstance(self.slot_caches[0], QuantKV))
        if why is not None:
            return why
        graphs = DecodeGraphs(self.model, self.kv_caches, capture_sizes(max_num_seqs),
                              self.max_blocks_per_seq, self.max_model_len, self.device,
                              self.attention_backend)
        graphs.capture(capturer)
        self.graphs = graphs
        return None

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step as flat tensors and its AttentionMetadata, through the host buffers.

        Long because it is the step's one layout pass: a loop over the scheduled requests,
        then the fills of the buffers' numpy views that reuse its arrays (offsets, positions,
        attention rows, each KV group's tables and slots), then the metadata over them."""
        assert self.kv is not None, "a tensor-parallel worker's runner gets its steps prepared"
        bs = self.block_size
        self.buffers.wait_until_free()
        buf = self.buffers.np
        n_seqs = len(out.scheduled)
        q_lens = np.empty(n_seqs, dtype=np.int64)
        starts = np.empty(n_seqs, dtype=np.int64)
        tokens: list[int] = []
        num_groups = self.layout.num_groups
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        sampling: list[Request] = []
        last_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        prompt_rows: list[int] = []
        pool_spans: list[tuple[Request, int, int]] = []
        pool_rows: list[int] = []
        offset = 0
        for i, req in enumerate(out.scheduled):
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            q_lens[i], starts[i] = n, start
            drafts = out.spec_tokens.get(req.request_id, ())
            d = len(drafts)  # speculative: every draft's row is a verification row
            tokens.extend(req.tokens_slice(start, start + n - d))
            tokens.extend(drafts)
            for g in range(num_groups):
                tables[g].append(self.kv.block_ids(req.request_id, g))
            if req.sampling_params.prompt_logprobs is not None:
                end = min(start + n, req.num_prompt_tokens - 1)
                if end > start:
                    prompt_spans.append((req, start, end - start))
                    prompt_rows.extend(range(offset, offset + end - start))
            if req.pooling_params is not None:
                pool_spans.append((req, start, n))
                pool_rows.extend(range(offset, offset + n))
            offset += n
            if start + n - d == req.num_tokens and req.wants_token:
                sampling.append(req)
                last_rows.extend(range(offset - 1 - d, offset))
        total = offset
        if self.lora is not None:  # per-token adapter rows, grouped for the LoRA deltas
            self.lora.begin_step([r.lora_request for r in out.scheduled], q_lens, self.device)
        qsl = buf["query_start_loc"][:n_seqs + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:])
        seq_lens = starts + q_lens
        buf["seq_lens"][:n_seqs] = seq_lens
        buf["input_ids"][:total] = tokens
        # Positions: for each sequence start..start+n-1, built without a Python loop per token.
        seq_of_token = np.repeat(np.arange(n_seqs), q_lens)
        positions = buf["positions"][:total]
        np.subtract(np.arange(total, dtype=np.int64), (qsl[:-1] - starts)[seq_of_token],
                    out=positions)
        # Each token as an attention row: it sees its own and every earlier key of its sequence.
        np.add(positions, 1, out=buf["row_lens"][:total])
        buf["row_seq_idx"][:total] = seq_of_token
        max_blocks = max(len(t) for t in tables[0])
        for g in range(num_groups):
            sfx = str(g) if g else ""
            block_tables = buf["block_tables" + sfx][:n_seqs * max_blocks].reshape(n_seqs,
                                                                                 max_blocks)
            block_tables[:] = 0
            for i, t in enumerate(tables[g]):
                block_tables[i, :len(t)] = t
            np.add(block_tables[seq_of_token, positions // bs].astype(np.int64) * bs,
                   positions % bs, out=buf["slot_mapping" + sfx][:total])
        n_sample = len(last_rows)
        buf["logits_indices"][:n_sample] = last_rows
        b = self.buffers
        meta = (GroupedMetadata if num_groups > 1 else AttentionMetadata)(
            slot_mapping=b.take("slot_mapping", total),
            block_tables=b.take("block_tables", n_seqs * max_blocks).view(n_seqs, max_blocks),
            seq_lens=b.take("seq_lens", n_seqs),
            query_start_loc=b.take("query_start_loc", n_seqs + 1),
            max_seq_len=int(seq_lens.max()),
            max_query_len=int(q_lens.max()),
            backend=self.attention_backend,
        )
        if self.attention_backend == "cpu":  # only its kernels read rows (GPU kernels find them)
            meta.row_lens = b.take("row_lens", total)
            meta.row_seq_idx = b.take("row_seq_idx", total)
        if isinstance(meta, GroupedMetadata):  # the same step with each group's tables
            meta.groups = [AttentionMetadata(
                slot_mapping=b.take(f"slot_mapping{g}", total),
                block_tables=b.take(f"block_tables{g}", n_seqs * max_blocks).view(n_seqs,
                                                                                max_blocks),
                seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc,
                max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len,
                row_lens=meta.row_lens, row_seq_idx=meta.row_seq_idx,
                backend=self.attention_backend) for g in range(1, num_groups)]
        inputs = StepInputs(
            input_ids=b.take("input_ids", total),
            positions=b.take("positions", total),
            meta=meta,
            logits_indices=b.take("logits_indices", n_sample),
            sampling=sampling,
            prompt_spans=prompt_spans,
            prompt_rows=prompt_rows,
            pool_spans=pool_spans,
            pool_rows=pool_rows,
        )
        b.mark_copied()
        return inputs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run the step: logits for each sampling request (and prompt positions if asked)."""
        inputs = self.prepare(out)
        if out.tier_moves and self.tier is not None:  # before the forward writes any block
            try:
                apply_tier_moves(self.slot_caches, out.tier_moves, self.tier)
            except BaseException:  # blocks never filled must not stay findable
                for block_id, _ in out.tier_moves.loads:
                    self.kv.pool.uncache(self.kv.pool.blocks[block_id])
                raise
        return step_result(inputs, self.forward(inputs, out.block_copies), self.device)

    def forward(self, inputs: StepInputs, block_copies: list[tuple[int, int]]
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(prompt-row logits, sampling-row logits, pooling rows' hidden states) of a
        prepared step; the part every tensor-parallel rank runs (the others get None logits:
        rank 0 gathers them, engine/kserve_paged_engine/worker/tp_executor.py)."""
        if block_copies:  # copy-on-write: shared blocks this step writes into
            n = len(block_copies)  # one upload: the sources, then the destinations
            ids = upload([s for s, _ in block_copies] + [d for _, d in block_copies],
                         torch.long, self.device)
            kernels.copy_blocks(self.slot_caches, ids[:n], ids[n:])
        size = (None if self.graphs is None or self.lora is not None
                else self.graphs.size_for(inputs.input_ids.shape[0], inputs.meta))
        try:
            if size is not None:
                hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, size)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                    inputs.meta)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        prompt_logits = logits = pooled = None
        if inputs.pool_rows:
            pooled = hidden.index_select(0, upload(inputs.pool_rows, torch.long, hidden.device))
        if inputs.prompt_rows:
            rows = upload(inputs.prompt_rows, torch.long, hidden.device)
            prompt_logits = self.model.compute_logits(hidden.index_select(0, rows))
        if inputs.logits_indices.numel():
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return prompt_logits, logits, pooled
