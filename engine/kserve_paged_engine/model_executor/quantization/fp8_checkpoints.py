"""vLLM's `fp8` method: fp8 checkpoints (config.json's `quantization_config.quant_method`
`fp8`, what vLLM's and AutoFP8's exporters and DeepSeek's block-quantized releases write), and
`--quantization fp8` on a float checkpoint (e4m3 weights quantized at load).

| stored | tensors |
|---|---|
| per tensor | `weight` float8_e4m3fn `[out, in]`, `weight_scale` one float (`w = q s`); `input_scale` with `activation_scheme: static` |
| blocks (`weight_block_size` [bn, bk], e.g. [128, 128]) | `weight`, `weight_scale_inv [ceil(out / bn), ceil(in / bk)]`, multiplied in spite of its name (`w = q s[i / bn, j / bk]`) |

Served as `Fp8Weight` (q/k/v and gate/up stacked along the output; a fused projection whose
parts are not whole row blocks is dequantized): on CUDA the Triton fp8 GEMM; on CPU with
float32 activations our native kernel, which decodes the e4m3 codes in registers at one byte
a weight (a block's scale becomes one per row and group of bk inputs); otherwise (bf16, no
native library, bk not dividing the inputs) dequantized at load, said in the log. Activations
stay in the model's dtype everywhere (vLLM quantizes them to fp8 on GPUs with fp8 units; not
built), so a static `input_scale` is read past and the log says so. `ignored_layers` are
stored float and load as such. On-the-fly (`--quantization fp8`): each projection's weight to
e4m3 with one scale, max |w| / 448, for the whole (fused) projection, which is where vLLM ends
after requantizing its parts to their largest scale.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.quantization.layouts import Picker, hf_parts
from kserve_paged_engine.model_executor.quantization.tp_cuts import (
    CutOf,
    cut_float,
    cut_parts,
    one_cut,
)
from kserve_paged_kernels import quant_linear

logger = logging.getLogger("kserve_paged_engine")

METHOD = "fp8"
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
PARTS = ("weight_scale", "weight_scale_inv", "input_scale")
CPU_WHY = ("dequantized at load: the native e4m3 kernel takes float32 activations, whole "
           "blocks of inputs and the native library")
CPU = torch.device("cpu")


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    """What the checkpoint's `quantization_config` says, checked before any weight is read."""

    activation_scheme: str  # "dynamic" or "static"
    block: tuple[int, int] | None  # `weight_block_size`; None: one scale per tensor


def read_config(raw_config: dict[str, Any]) -> Fp8Scheme:
    """The scheme of an fp8 checkpoint; ValueError for one not served."""
    qc = raw_config["quantization_config"]
    acts = str(qc.get("activation_scheme", "dynamic"))
    if acts not in ("dynamic", "static"):
        raise ValueError(f"fp8 checkpoint with activation_scheme {acts!r}: dynamic or static")
    fmt = str(qc.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint with fmt {fmt!r}: only e4m3 is served")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise ValueError(f"fp8 weight_block_size {block}: two positive sizes [out, in]")
    return Fp8Scheme(acts, None if block is None else (int(block[0]), int(block[1])))


@dataclass(slots=True)
class StoredFp8:
    """One projection as stored: e4m3 codes and scales per row `[out]` or per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int] | None

    def dequant(self) -> torch.Tensor:
        return self.codes.float() * quant_linear.expand_blocks(self.scales, self.block,
                                                               self.codes.shape)


@dataclass(slots=True)
class Fp8Reader:
    """The checkpoint's stream as float weights (as `Int4Reader.stream`), keeping each
    projection's fp8 form for `picker`."""

    scheme: Fp8Scheme
    stored: dict[str, StoredFp8] = field(default_factory=dict)
    static_inputs: int = 0
    cut: CutOf | None = None  # tensor parallelism, as `Int4Reader.cut`

    def stream(self, weights: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf in PARTS or (leaf == "weight" and tensor.dtype == torch.float8_e4m3fn):
                pending.setdefault(prefix, {})[leaf] = tensor
            else:
                yield name, cut_float(name, tensor, self.cut)
        for prefix, parts in pending.items():
            if "weight" not in parts:
                raise ValueError(f"fp8 checkpoint: {prefix} has scales but no fp8 weight")
            self.static_inputs += "input_scale" in parts
            cut = one_cut(prefix, self.cut(f"{prefix}.weight")) if self.cut else None
            if cut is not None:
                _stored(prefix, parts, self.scheme.block)  # the whole tensor's checks first
                parts = cut_parts(prefix, parts, cut, self.scheme.block)
            self.stored[prefix] = _stored(prefix, parts, self.scheme.block)
            yield f"{prefix}.weight", self.stored[prefix].dequant()

    def picker(self, dtype: torch.dtype, triton: bool | None = None) -> Picker:
        """fp8 projections as `served` gives them: the Triton GEMM's `Fp8Weight` (CUDA), our
        native kernel's (CPU, float32 activations), else dequantized."""
        floating = str(dtype).removeprefix("torch.")
        if self.static_inputs:
            logger.info("fp8 checkpoint: %d static input scales are not used; activations "
                        "stay %s", self.static_inputs, floating)

        def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
            names = hf_parts(name)
            cuda = linear.weight.device.type == "cuda" if triton is None else triton
            if not all(n in self.stored for n in names):
                return floating, None  # `ignored_layers`: stored float
            stacked = stack([self.stored[n] for n in names])
            if stacked is None:
                return f"{floating} (fp8 blocks not whole across the fused parts)", None
            return served(stacked, linear.weight.device if cuda else CPU, dtype)
        return pick


def _stored(prefix: str, parts: dict[str, torch.Tensor], block: tuple[int, int] | None
            ) -> StoredFp8:
    codes = parts["weight"]
    if block is not None:
        scale = parts.get("weight_scale_inv")
        grid = (-(-codes.shape[0] // block[0]), -(-codes.shape[1] // block[1]))
        if scale is None or tuple(scale.shape) != grid:
            raise ValueError(f"fp8 checkpoint: {prefix} needs weight_scale_inv of shape {grid} "
                             f"for blocks {list(block)}")
        return StoredFp8(codes, scale.float(), block)
    scale = parts.get("weight_scale")
    if scale is None or scale.numel() not in (1, codes.shape[0]):
        raise ValueError(f"fp8 checkpoint: {prefix} needs a weight_scale per tensor or row")
    return StoredFp8(codes, scale.float().reshape(-1).expand(codes.shape[0]).contiguous(), None)


def stack(parts: list[StoredFp8]) -> StoredFp8 | None:
    """Parts stacked along the output (q/k/v, gate/up) as one; None when block scales would
    not line up (a part's rows not a whole number of blocks)."""
    block = parts[0].block
    if block is not None and any(p.codes.shape[0] % block[0] for p in parts[:-1]):
        return None
    if len(parts) == 1:
        return parts[0]
    return StoredFp8(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                     block)


def served(stored: StoredFp8, device: torch.device, dtype: torch.dtype
           ) -> tuple[str, quant_linear.QuantWeight | None]:
    """(the log's words, the weight) for codes on `device`: the Triton GEMM's on CUDA, our
    native kernel's at one byte on CPU with float32 activations, else None (dequantized)."""
    if device.type == "cuda":
        codes, scales = stored.codes.to(device), stored.scales.to(device)
        return "fp8 e4m3 (Triton)", quant_linear.Fp8Weight(codes.contiguous(),
                                                           scales.contiguous(),
                                                           *codes.shape, stored.block)
    weight = (quant_linear.pack_fp8(stored.codes, stored.scales, stored.block)
              if dtype == torch.float32 else None)
    if weight is None:
        return f"{str(dtype).removeprefix('torch.')} (fp8, {CPU_WHY})", None
    return "fp8 e4m3 (one byte)", weight


def quantize(w: torch.Tensor, peak: float | None = None) -> StoredFp8:
    """e4m3 codes of a float weight with one scale, max |w| / 448 (vLLM's per-tensor); `peak`:
    the whole tensor's max |w| when `w` is a tensor-parallel shard of it."""
    wf = w.detach().float()
    amax = float(wf.abs().max()) if peak is None else peak
    scale = torch.tensor(amax / E4M3_MAX if amax > 0 else 1.0)
    codes = (wf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return StoredFp8(codes, scale.expand(w.shape[0]).contiguous(), None)


def on_the_fly(dtype: torch.dtype, whole: Any = None) -> Picker:
    """`--quantization fp8`: each projection to e4m3 with one scale, served as `served` says;
    where it is dequantized the float weight becomes its fp8 value in place. `whole`
    (tensor parallelism, tp_online.WholeRows): the scale of the whole projection, not the
    shard's."""

    def pick(name: str, linear: Linear) -> tuple[str, quant_linear.QuantWeight | None]:
        stored = quantize(linear.weight, None if whole is None else whole.tensor_peak(name))
        fmt, weight = served(stored, linear.weight.device, dtype)
        if weight is None:
            with torch.no_grad():
                linear.weight.copy_(stored.dequant().to(linear.weight.dtype))
        return fmt.replace("fp8", "fp8 per tensor", 1), weight
    return pick
