"""AWQ's and GPTQ's 4-bit weight layouts: how their int32 words hold codes, and the weight a
checkpoint's tensors stand for. One home for the formats' rules; the engine reads checkpoints
with it (engine/kserve_paged_engine/model_executor/quantization/int4_checkpoints.py) and the Triton GEMM
(kernels/kserve_paged_kernels/quant_gemm_triton.py) reads the same words in its loop.

Both store `w = (q - z) s` per group of input features, as int32 words of eight codes:
- AWQ (`version: gemm`): `qweight [in, out / 8]`, `qzeros [in / group, out / 8]`, both packed
  along the output dimension, nibble i of a word holding output column `8 c + AWQ_ORDER[i]`.
- GPTQ: `qweight [in / 8, out]` packed along the input dimension in order, `qzeros
  [groups, out / 8]` in order, stored as `z - 1` by the original format (`zero_offset` 1) and
  as `z` by `gptq_v2`; `g_idx [in]` names each input feature's group (activation order puts
  inputs of one group anywhere).
Both: `scales [groups, out]`, fp16 as written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i of a word


@dataclass(slots=True)
class CheckpointInt4Weight:
    """A `[out, in]` weight kept in its checkpoint's AWQ or GPTQ words (the Triton GEMM's input
    on CUDA)."""

    qweight: torch.Tensor  # int32, AWQ [in, out / 8], GPTQ [in / 8, out]
    qzeros: torch.Tensor  # int32 [groups, out / 8]
    scales: torch.Tensor  # [groups, out], the checkpoint's dtype
    g_idx: torch.Tensor  # int32 [in]: each input feature's group
    awq: bool
    zero_offset: int  # added to every stored zero
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.qzeros, self.scales, self.g_idx))


def unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words `[r, c]` -> their eight 4-bit codes (uint8), nibble i at index 8 w + i along
    `dim` (0 or 1)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    codes = ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)
    if dim == 0:
        codes = codes.movedim(-1, 1)  # [r, 8, c]
    shape = list(words.shape)
    shape[dim] *= 8
    return codes.reshape(shape)


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words `[rows, out / 8]` -> codes `[rows, out]` in output-column order."""
    codes = unpack(words, 1).reshape(words.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(j) for j in range(8)]
    return codes[..., inverse].reshape(words.shape[0], -1)


def codes_and_zeros(weight: CheckpointInt4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes `[in, out]`, zeros `[groups, out]` with the offset applied) as float32."""
    if weight.awq:
        codes, zeros = awq_columns(weight.qweight), awq_columns(weight.qzeros)
    else:
        codes = unpack(weight.qweight, 0)
        zeros = unpack(weight.qzeros, 1)[:, :weight.out_features]
    return codes.float(), zeros.float() + weight.zero_offset


def dequant_checkpoint(weight: CheckpointInt4Weight) -> torch.Tensor:
    """The float32 weight `[out, in]` the words stand for."""
    codes, zeros = codes_and_zeros(weight)
    g = weight.g_idx.long()
    return ((codes - zeros[g]) * weight.scales.float()[g]).t().contiguous()
