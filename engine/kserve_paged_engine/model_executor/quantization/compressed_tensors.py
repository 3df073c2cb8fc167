"""compressed-tensors checkpoints (what llm-compressor writes; config.json's
`quantization_config.quant_method` `compressed-tensors`, `quantization_status` `compressed`):
each quantized projection's tensors read by shape and dtype, served in the nearest layout here.

| format | tensors | served as |
|---|---|---|
| `pack-quantized` (W4A16) | `weight_packed [out, in / 8]` int32, eight codes a word along the input, stored `q + 8`; `weight_scale [out, groups]`; `weight_zero_point [out / 8, groups]` packed along the output when asymmetric; `weight_g_idx` with activation order | GPTQ's layout exactly (words transposed): `Int4Weight` on CPU, the Triton GEMM on CUDA (int4_checkpoints.py) |
| `int-quantized` / `naive-quantized` (W8A8, W8A16) | `weight` int8 (naive: integer values in a float dtype), `weight_scale [out, 1]` or `[1]` | `Int8Weight`, exact, on CPU; dequantized elsewhere or for group scales |
| `float-quantized` (FP8) | `weight` float8, `weight_scale [out, 1]` or `[1]` | the Triton fp8 GEMM on CUDA; on CPU e4m3 on the native kernel with float32 activations, else dequantized |

A W8A8 checkpoint whose `input_activations` are dynamic symmetric int8, per token or per
tensor, runs as vLLM runs it, activations quantized at each call (`W8A8Weight`,
kernels/kserve_paged_kernels/int8_dynamic.py), on a CPU with VNNI (avx512_vnni or avx_vnni),
where an int8 product has an instruction of its own and oneDNN's product is exact
(`int8_dynamic.kernel_exact`, asked of the kernel: a cap on oneDNN's ISA removes its VNNI path
even where the CPU has one). Elsewhere, on CUDA, and for other activation schemes (static,
asymmetric) the activations stay float and the int8 weights run weight-only. The start-up log
says which, and why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.quantization.int4_checkpoints import (
    Int4Checkpoint,
    Int4Reader,
)
from kserve_paged_engine.model_executor.quantization.layouts import Picker, hf_parts
from kserve_paged_engine.model_executor.quantization.tp_cuts import (
    CutOf,
    cut_float,
    cut_parts,
    one_cut,
)
from kserve_paged_kernels import int8_dynamic, quant_linear
from kserve_paged_kernels.cpu_native.isa import cpu_flags
from kserve_paged_kernels.int4_layouts import CheckpointInt4Weight, dequant_checkpoint

logger = logging.getLogger("kserve_paged_engine")

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
         "input_scale", "input_zero_point")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SYMMETRIC_ZERO_WORD = 0x88888888 - 2**32  # eight stored zeros of 8 (q + 8 for q = 0), as int32


@dataclass(slots=True, frozen=True)
class CTScheme:
    """What the checkpoint's `quantization_config` says, checked before any weight is read."""

    format: str
    activations: str | None  # e.g. "int 8 token" for W8A8; None: weight-only
    dynamic_int8: str | None = None  # "token" or "tensor": activations W8A8 can quantize


def read_config(raw_config: dict[str, Any]) -> CTScheme:
    """The scheme of a compressed-tensors checkpoint; ValueError for one not served."""
    qc = raw_config["quantization_config"]
    fmt = qc.get("format")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"{METHOD} checkpoint with quantization_status "
                         f"{qc.get('quantization_status')!r}: only compressed ones are served")
    if fmt not in FORMATS:
        raise ValueError(f"{METHOD} format {fmt!r} is not served; this engine reads "
                         f"{', '.join(FORMATS)}")
    groups = list((qc.get("config_groups") or {}).values())
    bits = {(g.get("weights") or {}).get("num_bits") for g in groups}
    if fmt == "pack-quantized" and bits != {4}:
        raise ValueError(f"{METHOD} pack-quantized with {sorted(bits, key=str)}-bit weights: "
                         "only 4-bit is served")
    acts = [g["input_activations"] for g in groups if g.get("input_activations")]
    said = None if not acts else " ".join(str(acts[0].get(k)) for k in ("type", "num_bits",
                                                                          "strategy"))
    return CTScheme(fmt, said, _dynamic_int8(acts[0]) if acts else None)


def _dynamic_int8(acts: dict[str, Any]) -> str | None:
    """The strategy of dynamic symmetric int8 activations ("token" or "tensor"), which
    `W8A8Weight` runs; None for any other activation scheme (static scales, asymmetric)."""
    if (acts.get("type") == "int" and acts.get("num_bits") == 8 and acts.get("dynamic") is True
            and acts.get("symmetric", True) and acts.get("strategy") in ("token", "tensor")):
        return str(acts["strategy"])
    return None


def _int4(parts: dict[str, torch.Tensor]) -> CheckpointInt4Weight:
    """pack-quantized tensors as GPTQ's words: `weight_packed` transposed is GPTQ's qweight,
    and the stored zero `z + 8` is the zero GPTQ subtracts from the stored code `q + 8`."""
    packed, scale = parts["weight_packed"].to(torch.int32), parts["weight_scale"]
    out_f = scale.shape[0]
    in_f = int(parts["weight_shape"][1]) if "weight_shape" in parts else packed.shape[1] * 8
    groups = scale.shape[1]
    zp = parts.get("weight_zero_point")
    qzeros = (torch.full((groups, (out_f + 7) // 8), SYMMETRIC_ZERO_WORD, dtype=torch.int32)
              if zp is None else zp.to(torch.int32).t().contiguous())
    g_idx = parts.get("weight_g_idx")
    g_idx = torch.arange(in_f) // (in_f // groups) if g_idx is None else g_idx
    return CheckpointInt4Weight(packed.t().contiguous(), qzeros, scale.t().contiguous(),
                                g_idx.to(torch.int32), False, 0, out_f, in_f)


def _per_row(scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A per-tensor or per-channel scale as one float32 per output row; None for group scales."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    return scale.float().reshape(rows) if scale.numel() == rows else None


@dataclass(slots=True)
class CTReader:
    """The checkpoint's stream as float weights (as `Int4Reader.stream`), keeping each
    projection's stored form for `picker`."""

    scheme: CTScheme
    int4: Int4Reader = field(default_factory=lambda: Int4Reader(Int4Checkpoint(METHOD, 0, 0)))
    int8: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cut: CutOf | None = None  # tensor parallelism, as `Int4Reader.cut`

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        naive = self.scheme.format == "naive-quantized"
        self.int4.cut = self.cut
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            quantized = leaf == "weight" and (naive or tensor.dtype == torch.int8
                                              or tensor.dtype in FP8)
            if leaf in PARTS or quantized:
                pending.setdefault(prefix, {})[leaf] = tensor
            else:
                yield name, cut_float(name, tensor, self.cut)
        for prefix, parts in pending.items():
            if "weight_scale" not in parts:  # a layer the checkpoint left float (`ignore`)
                yield f"{prefix}.weight", cut_float(f"{prefix}.weight", parts["weight"],
                                                    self.cut)
                continue
            yield f"{prefix}.weight", self._decode(prefix, parts)

    def _decode(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight `[out, in]` (this rank's cut), keeping the stored form for
        `picker`."""
        if "weight_packed" in parts:
            self.int4.weights[prefix] = self.int4.cut_stored(prefix, _int4(parts))
            return dequant_checkpoint(self.int4.weights[prefix])
        cut = one_cut(prefix, self.cut(f"{prefix}.weight")) if self.cut is not None else None
        if cut is not None:
            parts = cut_parts(prefix, parts, cut)
        w, scale = parts["weight"], parts["weight_scale"].float()
        rows = _per_row(scale, w.shape[0])
        zero = parts.get("weight_zero_point")
        if w.dtype in FP8:
            if rows is not None:
                self.fp8[prefix] = (w, rows)
            return w.float() * (rows[:, None] if rows is not None else _expand(scale, w))
        codes = w.float().round()
        if zero is not None:
            codes = codes - (zero.float() if zero.numel() == 1 else _expand(zero.float(), w))
        else:  # symmetric: the codes and a scale per row or per group, for `pack_int8`
            self.int8[prefix] = (codes.to(torch.int8), rows[:, None] if rows is not None
                                 else scale.reshape(w.shape[0], -1))
        return codes * (rows[:, None] if rows is not None else _expand(scale, w))

    def picker(self, dtype: torch.dtype, triton: bool | None = None) -> Picker:
        """int4 projections as `Int4Reader` picks them; int8 ones as `W8A8Weight` (dynamic int8
        activations, a CPU with VNNI) or `Int8Weight` (CPU); fp8 ones for the Triton fp8 GEMM
        (CUDA) or the native e4m3 kernel (CPU, float32); the rest dequantized, said in the
        log."""
        int4_pick = self.int4.picker(dtype, triton)
        floating = str(dtype).removeprefix("torch.")
        w8a8 = self.int8_activations(bool(triton))  # the loader passes triton for CUDA

        def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
            names = hf_parts(name)
            cuda = linear.weight.device.type == "cuda" if triton is None else triton
            if all(n in self.int4.weights for n in names):
                return int4_pick(name, linear)
            if all(n in self.int8 for n in names) and not cuda:
                kept = _int8(self.int8, names, dtype, w8a8)
                if kept is not None:
                    return kept
            if all(n in self.fp8 for n in names):
                w8, rows = (torch.cat(t) for t in zip(*(self.fp8[n] for n in names),
                                                      strict=True))
                dev = linear.weight.device
                if cuda:
                    return f"{METHOD} fp8 (Triton)", quant_linear.Fp8Weight(
                        w8.to(dev).contiguous(), rows.to(dev), *w8.shape)
                native = (quant_linear.pack_fp8(w8.contiguous(), rows, None)
                          if dtype == torch.float32 else None)
                if native is not None:  # e4m3 at one byte (e5m2, bf16: dequantized)
                    return f"{METHOD} fp8 e4m3 (one byte)", native
            return f"{floating} ({METHOD}, dequantized here)", None
        return pick

    def int8_activations(self, cuda: bool) -> str | None:
        """The activation strategy W8A8 projections quantize with ("token"/"tensor"), or None:
        activations stay float. Logs the choice and its reason (the CPU's VNNI flag)."""
        said = self.scheme.activations
        if said is None or not self.int8:
            return None
        strategy = self.scheme.dynamic_int8
        flag = (None if cuda or strategy is None or not int8_dynamic.available()
                else int8_dynamic.vnni(cpu_flags()))
        if flag is not None and int8_dynamic.kernel_exact():
            logger.info("%s W8A8: activations quantized to int8 per %s at each call (dynamic, "
                        "symmetric), int8 x int8 products on this CPU's %s (oneDNN qlinear)",
                        METHOD, strategy, flag)
            return strategy
        why = ("on CUDA" if cuda else "only dynamic symmetric int8 per token or tensor is run"
               if strategy is None else "this CPU has no VNNI (avx512_vnni or avx_vnni)"
               if flag is None else "oneDNN's int8 product is not exact on this CPU (without "
               "VNNI it halves the weights; ONEDNN_MAX_CPU_ISA may cap it there)")
        logger.info("%s checkpoint quantizes activations (%s): they stay float here (%s), "
                    "the int8 weights run weight-only", METHOD, said, why)
        return None


def _int8(stored: dict[str, tuple[torch.Tensor, torch.Tensor]], names: list[str],
          dtype: torch.dtype, w8a8: str | None = None
          ) -> tuple[str, quant_linear.QuantWeight] | None:
    """Symmetric int8 projections (stacked for a fused one): per-channel scales with `w8a8`
    (an activation strategy) as `W8A8Weight`; else `Int8Weight`, any group size on the native
    kernel (float32), one scale per channel on PyTorch's; None when neither holds them."""
    codes = torch.cat([stored[n][0] for n in names])
    groups = {stored[n][1].shape[1] for n in names}
    if len(groups) != 1:
        return None
    scale = torch.cat([stored[n][1] for n in names])
    group_size = codes.shape[1] // scale.shape[1]
    if w8a8 is not None and scale.shape[1] == 1:
        return (f"{METHOD} W8A8 (int8 per-channel, int8 activations per {w8a8})",
                int8_dynamic.pack_w8a8(codes.contiguous(), scale, w8a8 == "token"))
    try:
        weight = quant_linear.pack_int8(codes.contiguous(), scale, group_size, dtype)
    except ValueError:
        return None
    kind = "per-channel" if group_size == codes.shape[1] else f"g{group_size}"
    return f"{METHOD} int8 {kind}", weight


def _expand(per_group: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A `[out, groups]` scale or zero repeated over each group's inputs: `[out, in]`."""
    return per_group.repeat_interleave(w.shape[1] // per_group.shape[1], dim=1)
