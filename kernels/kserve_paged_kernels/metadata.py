"""One step's attention metadata: the contract between the model runner and the backends.

The runner builds it once per step (`engine/kserve_paged_engine/worker/model_runner.py`) and every layer hands the same
object to the kernels, so what a backend derives from it (the CPU backend's per-row lists and
gather plan) is derived once per step and kept on the object (`plan`), never in module state.
Callers that hold only the raw tensors (tests, benchmarks) get one through `build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what context each sequence has.

    slot_mapping: int64 `[num_tokens]`, cache slot of each new token (`< 0`: do not store).
    block_tables: int32 `[num_seqs, max_blocks]`, each sequence's physical blocks in order.
    seq_lens: int32 `[num_seqs]`, context length including the new tokens.
    query_start_loc: int32 `[num_seqs + 1]`, offsets of each sequence's new tokens.
    max_seq_len / max_query_len: host-side maxima, so kernels need no device sync to size grids.
    row_lens / row_seq_idx: every new token as one attention row: how many keys it sees (int32;
      its own and every earlier token of its sequence, which is how causality is expressed) and
      its sequence's block-table row (int64). None until `rows()` computes them, or when some
      tokens belong to no sequence (padding rows).
    backend: the paged-attention backend for this step, chosen once by the runner
      (`kserve_paged_kernels.resolve_backend`); None: resolved per call.
    plan: what a backend derived from the fields above for this step; built by the first layer
      that needs it and reused by the others (the CPU backend keeps one per sliding-window
      size, so Gemma's local and global layers each derive theirs once). The fields above must
      not change once it is set. A layer's own window and softcap are not here: they come
      with each `attend` call, since one step's metadata serves every layer.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_query_len: int
    row_lens: torch.Tensor | None = None
    row_seq_idx: torch.Tensor | None = None
    backend: str | None = None
    plan: Any = None

    @classmethod
    def build(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, slot_mapping: torch.Tensor | None = None, *,
              max_seq_len: int | None = None, max_query_len: int | None = None,
              backend: str | None = None) -> AttentionMetadata:
        """Metadata from raw tensors; the host maxima are read from them when not given (one
        device sync on CUDA)."""
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
        if max_query_len is None:
            q_lens = query_start_loc[1:] - query_start_loc[:-1]
            max_query_len = int(q_lens.max()) if q_lens.numel() else 0
        if slot_mapping is None:
            slot_mapping = torch.full((0,), -1, dtype=torch.long, device=seq_lens.device)
        return cls(slot_mapping, block_tables, seq_lens, query_start_loc, max_seq_len,
                   max_query_len, backend=backend)

    def rows(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(row_lens, row_seq_idx)` for `num_tokens` new tokens, computed once; None when some
        tokens belong to no sequence (padding). ValueError for a sequence with more new tokens
        than context."""
        if self.row_lens is not None and self.row_seq_idx is not None:
            return (self.row_lens, self.row_seq_idx) if self.row_lens.numel() == num_tokens \
                else None
        qsl = self.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = self.seq_lens.long()
        if bool((q_lens > seq_lens).any()):
            bad = int((q_lens > seq_lens).nonzero()[0, 0])
            raise ValueError(f"sequence {bad}: q_len {int(q_lens[bad])} > seq_len "
                             f"{int(seq_lens[bad])}")
        seq_idx = torch.repeat_interleave(torch.arange(q_lens.numel(), device=qsl.device), q_lens)
        offset = torch.arange(seq_idx.numel(), device=qsl.device) - qsl[seq_idx]
        self.row_lens = ((seq_lens - q_lens + 1)[seq_idx] + offset).to(torch.int32)
        self.row_seq_idx = seq_idx
        return (self.row_lens, self.row_seq_idx) if seq_idx.numel() == num_tokens else None
