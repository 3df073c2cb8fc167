"""Turns one scheduler step into flat tensors, runs the model once, returns sampling logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Requests whose scheduled tokens reach their end, in logits-row order.
    sampling: list[Request]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # Zeros, not empty: a partly filled last block is read (and masked); NaN garbage there
        # would still poison the softmax.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(model.num_layers)]

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * block_size * model.num_kv_heads * model.head_dim * elem * model.num_layers

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        n_seqs = len(out.scheduled)
        q_lens = np.empty(n_seqs, dtype=np.int64)
        starts = np.empty(n_seqs, dtype=np.int64)
        tokens: list[int] = []
        tables: list[list[int]] = []
        sampling: list[Request] = []
        last_rows: list[int] = []
        offset = 0
        for i, req in enumerate(out.scheduled):
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            q_lens[i], starts[i] = n, start
            tokens.extend(req.tokens_slice(start, start + n))
            tables.append(self.kv.block_ids(req.request_id))
            offset += n
            if start + n == req.num_tokens:
                sampling.append(req)
                last_rows.append(offset - 1)
        seq_lens = starts + q_lens
        qsl = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        # Positions: for each sequence start..start+n-1, built without a Python loop per token.
        seq_of_token = np.repeat(np.arange(n_seqs), q_lens)
        positions = np.arange(total, dtype=np.int64) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((n_seqs, max_blocks), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        slot_mapping = (block_tables[seq_of_token, positions // bs] * bs + positions % bs)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            max_seq_len=int(seq_lens.max()),
            max_query_len=int(q_lens.max()),
        )
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.tensor(last_rows, dtype=torch.long, device=dev),
            sampling=sampling,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run the step; return float32 logits `[len(sampling), vocab]` and those requests."""
        inputs = self.prepare(out)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampling:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return logits, inputs.sampling
