"""AWQ's and GPTQ's 4-bit packing, written here from the formats' definitions (not from the
engine's reader), so a test that packs with these and reads with the engine checks both sides
against the format, not against each other alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output column 8c + this
IN_ORDER = list(range(8))


def int32_words(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(codes: torch.Tensor, dim: int, order: list[int]) -> torch.Tensor:
    """Eight 4-bit codes a word along `dim`, nibble i taking index 8 w + order[i]."""
    c = codes.long().movedim(dim, -1)
    words = torch.zeros(*c.shape[:-1], c.shape[-1] // 8, dtype=torch.long)
    for i, j in enumerate(order):
        words |= c[..., j::8] << (4 * i)
    return int32_words(words.movedim(-1, dim)).contiguous()


def quantize(w: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit codes of `w` [out, in] with input i in group g_idx[i]: (codes [in, out],
    fp16 scales [groups, out], zeros [groups, out], the float32 weight [out, in] they stand
    for). Zeros from 1: GPTQ's original format stores z - 1 in a nibble, so z = 0 cannot be
    written (its kernels read it back as 16)."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w.shape[0])
    zeros = torch.empty(groups, w.shape[0])
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1), cols.amax(1)
        scales[g] = ((hi - lo) / 15).half().float()
        zeros[g] = (-lo / scales[g]).round().clamp(1, 15)
    codes = (w.t() / scales[g_idx] + zeros[g_idx]).round().clamp(0, 15)
    deq = ((codes - zeros[g_idx]) * scales[g_idx]).t().contiguous()
    return codes.to(torch.uint8), scales.half(), zeros.to(torch.uint8), deq


def checkpoint_parts(w: torch.Tensor, g_idx: torch.Tensor, method: str
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's tensors as `method` ("awq" or "gptq", original format) stores them,
    and the float32 weight they stand for."""
    codes, scales, zeros, deq = quantize(w.float(), g_idx)
    if method == "awq":
        parts = {"qweight": pack_along(codes, 1, AWQ_PACK_ORDER),
                 "qzeros": pack_along(zeros, 1, AWQ_PACK_ORDER)}
    else:
        parts = {"qweight": pack_along(codes, 0, IN_ORDER),
                 "qzeros": pack_along((zeros.long() - 1) & 0xF, 1, IN_ORDER),
                 "g_idx": g_idx.to(torch.int32)}
    return parts | {"scales": scales}, deq


def read_checkpoint(reader_class: Any, read_config: Any, folder: Path) -> Any:
    """A quantized checkpoint folder streamed through one of the engine's readers (as the
    loader does), returning the reader with every projection's stored form kept."""
    from safetensors.torch import load_file

    reader = reader_class(read_config(json.loads((folder / "config.json").read_text())))
    for _ in reader.stream(iter(load_file(folder / "model.safetensors").items())):
        pass
    return reader
