"""The CPU backend's plan of one step: the gather indices and masks that `cpu_backend` builds
from the step's metadata (once, kept on it) and that its native and SDPA paths read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeChunk:
    token_idx: torch.Tensor  # [n] rows of `query`/output
    block_idx: torch.Tensor  # [n * num_blocks] physical blocks, row-major
    padded_len: int  # num_blocks * block_size
    mask: torch.Tensor | None  # [n, 1, 1, padded_len] True = attend; None if nothing padded


@dataclass
class PrefillItem:
    q_start: int
    q_end: int
    seq_len: int
    block_idx: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [q_len, seq_len] or None -> is_causal (q_len == seq_len)


@dataclass
class WindowItem:
    q_start: int
    q_end: int
    first_key: int  # position of the first key gathered (a block boundary)
    num_keys: int  # keys gathered: first_key .. seq_len - 1
    block_idx: torch.Tensor  # [num_blocks] the blocks holding them
    mask: torch.Tensor  # [q_len, num_keys] True = attend (causal and inside the window)


@dataclass
class Plan:
    decode: list[DecodeChunk] = field(default_factory=list)
    prefill: list[PrefillItem] = field(default_factory=list)
    num_valid_tokens: int = 0
    valid_rows: torch.Tensor | None = None  # arange(num_valid_tokens), for the native kernel
    # The decode rows for the native kernel alone: (token index, context length, sequence).
    decode_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    windowed: list[WindowItem] = field(default_factory=list)  # windowed / soft-capped layers
