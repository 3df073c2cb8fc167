"""Weight-only quantized matmuls on CPU, through PyTorch's packed kernels.

Why: a decode step reads every weight once per token, so on CPU its time is the weights' bytes;
4-bit weights are a fifth of float32's. Two layouts, each a dataclass the engine builds once:

- `Int4Weight`: 4-bit codes with a scale and an offset per group of 32/64/128 weights along the
  input dimension, `w = q * scale + minimum` (GGUF's Q4_0/Q4_1/Q4_K form), run by
  `aten._weight_int4pack_mm_for_cpu`. That kernel reads codes centred on 8
  (`w = (q - 8) * scale + zero`), so `zero = minimum + 8 * scale`; its scales and zeros are in the
  activation dtype, so float32 activations keep fp16 GGUF scales exactly, bfloat16 ones do not.
- `Int8Weight`: int8 codes with one symmetric scale per output channel, run by
  `aten._weight_int8pack_mm` (it takes no per-group scales).

The engine picks which layout a layer gets (engine/model_executor/quantization.py); this module
only packs and multiplies, and gives the dequantized float reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int4_layouts import CheckpointInt4Weight, dequant_checkpoint

INT4_GROUP_SIZES = (32, 64, 128)
_INNER_K_TILES = 2  # how the CPU packing tiles K; it reads any value, the matmul ignores it
_ROWS_MULTIPLE = 16  # the CPU packing takes output rows in multiples of 16 (ours are padded)


@dataclass(slots=True)
class Int4Weight:
    """A `[out, in]` weight as packed 4-bit codes plus a (scale, zero) pair per group."""

    packed: torch.Tensor  # uint8 [out16, in / 2], _convert_weight_to_int4pack_for_cpu's layout
    scale_zero: torch.Tensor  # [in / group, out16, 2] in the activation dtype
    # (out16: out_features padded to a multiple of 16 for the packing)
    group_size: int
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


@dataclass(slots=True)
class Int8Weight:
    """A `[out, in]` weight as int8 codes and one scale per output channel."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out] in the activation dtype
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


@dataclass(slots=True)
class Fp8Weight:
    """A `[out, in]` fp8 (e4m3/e5m2) weight and one float32 scale per output channel, as an fp8
    checkpoint stores it (CUDA: the Triton fp8 GEMM)."""

    weight: torch.Tensor  # float8 [out, in]
    scales: torch.Tensor  # float32 [out]
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


# The last two are CUDA's (Triton GEMMs); the first two PyTorch's packed CPU kernels.
QuantWeight = Int4Weight | Int8Weight | CheckpointInt4Weight | Fp8Weight


def _check_groups(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES} (got {group_size})")
    out_f, in_f = codes.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the group size {group_size}")
    if tuple(scale.shape) != (out_f, in_f // group_size):
        raise ValueError(f"scales of shape {tuple(scale.shape)} for a [{out_f}, {in_f}] weight "
                         f"in groups of {group_size}")


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> Int4Weight:
    """Pack codes `[out, in]` (0..15) with per-group `scale` and `minimum` `[out, in / group]`
    (`w = q * scale + minimum`) for `int4_mm` on activations of `dtype`."""
    _check_groups(codes, scale, group_size)
    if codes.dtype.is_floating_point or int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("int4 codes must be integers in 0..15")
    out_f = codes.shape[0]
    pad = -out_f % _ROWS_MULTIPLE  # zero rows, cut from the product again
    codes32 = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8)
    scale32, min32 = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad))
                      for t in (scale, minimum))
    zero = min32 + 8.0 * scale32
    scale_zero = torch.stack([scale32.t(), zero.t()], dim=-1).to(dtype).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32.contiguous(),
                                                               _INNER_K_TILES)
    return Int4Weight(packed, scale_zero, group_size, out_f, codes.shape[1])


def dequant_int4_reference(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """The float32 weight `q * scale + minimum` (the reference `int4_mm` is tested against)."""
    _check_groups(codes, scale, group_size)
    s = scale.float().repeat_interleave(group_size, dim=1)
    m = minimum.float().repeat_interleave(group_size, dim=1)
    return codes.float() * s + m


def quantize_int4(weight: torch.Tensor, group_size: int = 32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit codes of a float weight `[out, in]`: (codes, scale,
    minimum), each group spanning its own [min, max] (what `--quantization int4` runs)."""
    out_f, in_f = weight.shape
    if group_size not in INT4_GROUP_SIZES or in_f % group_size:
        raise ValueError(f"cannot split in_features {in_f} into int4 groups of {group_size}")
    groups = weight.detach().float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - lo[..., None]) / safe[..., None]).round().clamp(0, 15)
    return codes.to(torch.uint8).reshape(out_f, in_f), scale, lo


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float weight (scale = max |w| / 127): each weight
    moves by at most half its channel's scale."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(codes, scales.to(dtype).contiguous(), *w.shape)


def dequant(weight: QuantWeight) -> torch.Tensor:
    """The float32 weight a packed one stands for (for logs of the error and for tests)."""
    if isinstance(weight, Int8Weight):
        return weight.codes.float() * weight.scales.float()[:, None]
    if isinstance(weight, CheckpointInt4Weight):
        return dequant_checkpoint(weight)
    if isinstance(weight, Fp8Weight):
        return weight.weight.float() * weight.scales[:, None]
    eye = torch.eye(weight.in_features, dtype=weight.scale_zero.dtype)
    return int4_mm(eye, weight).float().t().contiguous()


def int4_mm(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`x @ w.T` for 2-D `x` `[rows, in]` in the dtype the scales were packed for."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), weight.packed, weight.group_size, weight.scale_zero)
    return out if out.shape[1] == weight.out_features else out[:, :weight.out_features]


def int8_mm(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`x @ w.T` for 2-D `x` `[rows, in]`."""
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.codes, weight.scales)


def int8_rows(ids: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized (an int8 embedding's lookup)."""
    return weight.codes[ids].to(weight.scales.dtype) * weight.scales[ids].unsqueeze(-1)


def matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """`x @ w.T` for `x` `[..., in]` of any leading shape."""
    rows = x.reshape(-1, weight.in_features)
    if isinstance(weight, CheckpointInt4Weight):
        from kernels.quant_gemm_triton import int4_gemm  # Triton: imported on CUDA only

        out = int4_gemm(rows, weight.qweight, weight.qzeros, weight.scales, weight.g_idx,
                        awq=weight.awq, zero_offset=weight.zero_offset)
    elif isinstance(weight, Fp8Weight):
        from kernels.quant_gemm_triton import fp8_gemm

        out = fp8_gemm(rows, weight.weight, weight.scales)
    elif isinstance(weight, Int4Weight):
        out = int4_mm(rows, weight)
    else:
        out = int8_mm(rows, weight)
    return out.reshape(*x.shape[:-1], weight.out_features)
