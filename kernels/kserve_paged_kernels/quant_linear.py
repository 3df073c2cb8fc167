"""Weight-only quantized matmuls on CPU: our native kernel in float32 (and in bfloat16 where
measured faster), PyTorch's packed ones otherwise.

Why: a decode step reads every weight once per token, so on CPU its time is the weights' bytes;
4-bit weights are a fifth of float32's. Two layouts, each a dataclass the engine builds once,
each run by one of two kernels (`kernel`, chosen at packing from the activation dtype):

- `Int4Weight`: 4-bit codes with a scale and a minimum per group of 32/64/128 weights along the
  input dimension, `w = q * scale + minimum` (GGUF's Q4_0/Q4_1/Q4_K form).
- `Int8Weight`: int8 codes with one scale per group along the input dimension, `w = q * scale`
  (GGUF's Q8_0: groups of 32), or one per output channel (a group of `in_features`).

`native` (float32 activations with the native library loaded; bfloat16 ones where
`cpu_native.native_bf16_quant()` says so): `cpu_native.quant_gemm`, which dequantizes in
registers (bf16 from a few rows on: into a bf16 tile per weight panel for the bf16 GEMM's
micro-kernel); scales are float32, so a GGUF's are kept exactly, and any group size runs (an
even one in bf16). `aten` (other dtypes, or no native library): `aten._weight_int4pack_mm_for_cpu`, which
reads codes centred on 8 (`zero = minimum + 8 * scale`) with scales in the activation dtype
(bfloat16 rounds fp16 GGUF scales), and `aten._weight_int8pack_mm`, which takes one scale per
output channel only. Both are 10-90x slower than `F.linear` with float32 activations, hence ours.

The engine picks which layout a layer gets (engine/kserve_paged_engine/model_executor/quantization/layouts.py); this module
only packs and multiplies, and gives the dequantized float reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native.abi import QUANT_E4M3
from kserve_paged_kernels.int4_layouts import CheckpointInt4Weight, dequant_checkpoint
from kserve_paged_kernels.int8_dynamic import W8A8Weight, dequant_w8a8, w8a8_mm

INT4_GROUP_SIZES = (32, 64, 128)
_INNER_K_TILES = 2  # how the CPU packing tiles K; it reads any value, the matmul ignores it
_ROWS_MULTIPLE = 16  # the CPU packing takes output rows in multiples of 16 (ours are padded)


@dataclass(slots=True)
class Int4Weight:
    """A `[out, in]` weight as packed 4-bit codes plus a (scale, zero) pair per group."""

    # native: the bytes of cpu_native.pack_q4; aten: uint8 [out16, in / 2],
    # _convert_weight_to_int4pack_for_cpu's layout (out16: out_features padded to 16 rows)
    packed: torch.Tensor
    scale_zero: torch.Tensor | None  # aten: [in / group, out16, 2] in the activation dtype
    group_size: int
    out_features: int
    in_features: int
    kernel: str = "aten"

    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.scale_zero is None else self.scale_zero.nbytes)


@dataclass(slots=True)
class Int8Weight:
    """A `[out, in]` weight as int8 codes and one scale per group of `group_size` inputs."""

    packed: torch.Tensor  # native: the bytes of cpu_native.pack_q8; aten: int8 codes [out, in]
    scales: torch.Tensor | None  # aten: [out] in the activation dtype (native: in `packed`)
    out_features: int
    in_features: int
    group_size: int  # aten: in_features (one scale per output channel)
    kernel: str = "aten"

    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.scales is None else self.scales.nbytes)


@dataclass(slots=True)
class Fp8Weight:
    """A `[out, in]` fp8 (e4m3/e5m2) weight and float32 scales, one per output channel or one
    per `block` tile of weights, as an fp8 checkpoint stores them: the Triton fp8 GEMM's
    (CUDA), or e4m3 packed for our native kernel (`pack_fp8`: CPU, float32 activations)."""

    weight: torch.Tensor  # float8 [out, in] (native: empty, the codes live in `packed`)
    scales: torch.Tensor  # float32 [out]; with `block` (bn, bk): [ceil(out / bn), ceil(in / bk)]
    out_features: int
    in_features: int
    block: tuple[int, int] | None = None
    packed: torch.Tensor | None = None  # native: cpu_native.pack_e4m3's bytes
    group_size: int = 0  # native: inputs per scale (in_features, or the block's bk)
    kernel: str = "triton"

    def nbytes(self) -> int:
        return (self.weight.nbytes + self.scales.nbytes if self.packed is None
                else self.packed.nbytes)


# CheckpointInt4Weight and Fp8Weight are CUDA's (Triton GEMMs); W8A8Weight quantizes the
# activations too (kernels/kserve_paged_kernels/int8_dynamic.py).
QuantWeight = Int4Weight | Int8Weight | CheckpointInt4Weight | Fp8Weight | W8A8Weight


def pack_fp8(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None
             ) -> Fp8Weight | None:
    """e4m3 codes `[out, in]` with per-row (`block` None) or block scales, packed for our
    native kernel at one byte a weight; None where it cannot take them (no native library, not
    e4m3, or blocks that do not split the inputs whole)."""
    out_f, in_f = codes.shape
    group = in_f if block is None else block[1]
    if (codes.dtype != torch.float8_e4m3fn or not cpu_native.quant_available()
            or in_f % group):
        return None
    rows = expand_blocks(scales, block, codes.shape)[:, ::group].contiguous()
    packed = cpu_native.pack_e4m3(codes, rows, group)
    return Fp8Weight(codes.new_empty(0), scales, out_f, in_f, block, packed, group, "native")


def native_for(dtype: torch.dtype) -> bool:
    """Whether weights for activations of `dtype` are packed for our kernel (float32 with the
    native library loaded; bfloat16 where `cpu_native.native_bf16_quant()`) rather than
    PyTorch's."""
    if dtype == torch.bfloat16:
        return cpu_native.native_bf16_quant()
    return dtype == torch.float32 and cpu_native.quant_available()


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
    if native_for(dtype):
        packed = cpu_native.pack_q4(codes, scale.float(), minimum.float(), group_size)
        return Int4Weight(packed, None, group_size, out_f, codes.shape[1], "native")
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


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype,
                  row_amax: torch.Tensor | None = None) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float weight (scale = max |w| / 127): each weight
    moves by at most half its channel's scale. `row_amax`: each row's max |w| when the weight
    is a tensor-parallel shard of its columns (the whole row's, so the scale is TP 1's)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) if row_amax is None else row_amax.float()) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return pack_int8(codes, scales[:, None], w.shape[1], dtype)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
              ) -> Int8Weight:
    """int8 codes `[out, in]` with `scale` `[out, in / group_size]` (`w = q * scale`) for
    `int8_mm` on activations of `dtype`. PyTorch's kernel takes one scale per output channel
    only: ValueError for smaller groups unless `native_for(dtype)` (bf16: an even group)."""
    out_f, in_f = codes.shape
    if codes.dtype != torch.int8 or group_size <= 0 or in_f % group_size or tuple(
            scale.shape) != (out_f, in_f // group_size):
        raise ValueError(f"int8 codes {codes.dtype} {list(codes.shape)} with scales "
                         f"{list(scale.shape)} in groups of {group_size}")
    if native_for(dtype) and (dtype == torch.float32 or group_size % 2 == 0):
        packed = cpu_native.pack_q8(codes, scale.float(), group_size)
        return Int8Weight(packed, None, out_f, in_f, group_size, "native")
    if group_size != in_f:
        raise ValueError("PyTorch's int8 kernel takes one scale per output channel only")
    return Int8Weight(codes.contiguous(), scale[:, 0].to(dtype).contiguous(), out_f, in_f, in_f)


def dequant(weight: QuantWeight) -> torch.Tensor:
    """The float32 weight a packed one stands for (for logs of the error and for tests)."""
    if isinstance(weight, Int8Weight):
        return int8_rows(torch.arange(weight.out_features), weight).float()
    if isinstance(weight, CheckpointInt4Weight):
        return dequant_checkpoint(weight)
    if isinstance(weight, Fp8Weight) and weight.packed is not None:  # read back: x = I
        return _native_mm(torch.eye(weight.in_features), weight).t().contiguous()
    if isinstance(weight, Fp8Weight):
        return weight.weight.float() * expand_blocks(weight.scales, weight.block,
                                                     weight.weight.shape)
    if isinstance(weight, W8A8Weight):
        return dequant_w8a8(weight)
    eye = torch.eye(weight.in_features, dtype=torch.float32 if weight.scale_zero is None
                    else weight.scale_zero.dtype)
    return int4_mm(eye, weight).float().t().contiguous()


def expand_blocks(scales: torch.Tensor, block: tuple[int, int] | None, shape: torch.Size
                  ) -> torch.Tensor:
    """Per-row scales `[out]` as `[out, 1]`, or block scales repeated over their tiles and cut
    to the weight's `[out, in]` (the last tiles may be partial)."""
    if block is None:
        return scales.float().reshape(-1, 1)
    full = scales.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[:shape[0], :shape[1]]


def int4_mm(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`x @ w.T` for 2-D `x` `[rows, in]` in the dtype the scales were packed for."""
    if weight.kernel == "native":
        return _native_mm(x, weight)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), weight.packed, weight.group_size, weight.scale_zero)
    return out if out.shape[1] == weight.out_features else out[:, :weight.out_features]


def int8_mm(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`x @ w.T` for 2-D `x` `[rows, in]`."""
    if weight.kernel == "native":
        return _native_mm(x, weight)
    assert weight.scales is not None
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.packed, weight.scales)


def bits_of(weight: QuantWeight) -> int:
    """The native kernel's `bits` for a weight on it (fp8: its e4m3 code)."""
    if isinstance(weight, Fp8Weight):
        return QUANT_E4M3
    return 4 if isinstance(weight, Int4Weight) else 8


def _native_mm(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Our kernel, the bias added inside it (as the native decoder stack does); float32 and
    bfloat16 rows natively, others through float32."""
    native = x.dtype in (torch.float32, torch.bfloat16)
    rows = x if native else x.float()
    bits = bits_of(weight)
    out = cpu_native.quant_gemm(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                weight.packed, bits, weight.group_size, weight.out_features,
                                bias)
    if out is None:  # packed for the loaded library, so only a broken call ends here
        raise RuntimeError(f"the native int{bits} kernel refused a {list(x.shape)} input")
    return out if native else out.to(x.dtype)


def int8_rows(ids: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized (an int8 embedding's lookup)."""
    if weight.kernel == "native":
        return cpu_native.q8_rows(weight.packed, weight.group_size, weight.in_features, ids)
    assert weight.scales is not None
    return weight.packed[ids].to(weight.scales.dtype) * weight.scales[ids].unsqueeze(-1)


def _triton_mm(rows: torch.Tensor, weight: CheckpointInt4Weight | Fp8Weight) -> torch.Tensor:
    """A checkpoint's stored words or fp8 codes through the Triton GEMMs (CUDA; imported only
    there, or in the interpreter)."""
    from kserve_paged_kernels.quant_gemm_triton import fp8_gemm, int4_gemm

    if isinstance(weight, Fp8Weight):
        return fp8_gemm(rows, weight.weight, weight.scales, block=weight.block)
    return int4_gemm(rows, weight.qweight, weight.qzeros, weight.scales, weight.g_idx,
                     awq=weight.awq, zero_offset=weight.zero_offset)


def matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`x @ w.T (+ bias)` for `x` `[..., in]` of any leading shape."""
    rows = x.reshape(-1, weight.in_features)
    if isinstance(weight, CheckpointInt4Weight) or (isinstance(weight, Fp8Weight)
                                                     and weight.kernel == "triton"):
        out = _triton_mm(rows, weight).reshape(*x.shape[:-1], weight.out_features)
        return out if bias is None else out + bias
    if isinstance(weight, W8A8Weight):
        out = w8a8_mm(rows, weight).to(x.dtype).reshape(*x.shape[:-1], weight.out_features)
        return out if bias is None else out + bias
    if weight.kernel == "native" and (bias is None or (
            bias.dtype == rows.dtype in (torch.float32, torch.bfloat16)
            and bias.is_contiguous())):
        out = _native_mm(rows, weight, None if bias is None else bias.detach())
        return out.reshape(*x.shape[:-1], weight.out_features)
    out = int4_mm(rows, weight) if isinstance(weight, Int4Weight) else int8_mm(rows, weight)
    out = out.reshape(*x.shape[:-1], weight.out_features)
    return out if bias is None else out + bias
