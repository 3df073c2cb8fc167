"""A quantized paged KV cache (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2|int8`): layout, store, read.

`QuantKV` is one layer's cache: `data` in the contract's layout `[2, num_blocks, block_size,
num_kv_heads, head_dim]` holding one-byte codes (int8, or torch's float8_e4m3fn /
float8_e5m2), and `scales` float32 `[2, num_blocks, num_kv_heads]`: the value of an element is
`code * scales[half, block, head]` (symmetric, no zero point). A scale is the block's largest
|x| of that head over the format's largest code (127, 448, 57344), so the biggest element
uses the whole range.

Growth as tokens are appended: a block is filled over several steps, and a later token may be
bigger than every earlier one. The store then raises the block's scale and requantizes the
block's existing codes of that head to it (`code * old / new`, rounded again), so one scale
per (block, head) always covers its block. Why this and not a scale per token slot: per-slot
scales cost 4 bytes per token and head (6% of a 64-dim int8 head), which would break "twice the
blocks of bf16 at the same memory"; a per-block scale costs 4 bytes per 16 x 64 codes (0.4%).
The price is a second rounding of the codes already there when the scale grows (at most half a
step of the new scale each, so an element is off by at most one new step in all), which happens
only while a block fills, mostly at its first few tokens. A write at a block's offset 0 starts
the block afresh (its scales reset to 0): blocks are filled from their first slot, so this is
where a reused block forgets its previous owner.

Every attention path reads the same thing: the reference dequantizes whole blocks, the CPU
backend's native kernel widens each code and applies its scale in fp32 (kernels/kserve_paged_kernels/cpu_kvq.py;
without the native library it dequantizes the step's blocks and runs its float kernels), and
the Triton kernel multiplies each K and V row by its scale as it loads it. `store_kv_quant`
here is the reference store; the native store on CPU (csrc/kv_q8.c) and the Triton store on
CUDA (kernels/kserve_paged_kernels/kv_quant_triton.py) write the same codes and scales bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kserve_paged_kernels import kv_formats

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def storage_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a `--kv-cache-dtype` stores codes in; None for `auto`."""
    return STORAGE.get(kv_formats.canonical(name))


@dataclass(slots=True)
class QuantKV:
    """One layer's quantized paged cache (module docstring). Quacks like the float cache
    where the dispatch reads it (`shape`, `device`, `dtype`: the codes')."""

    data: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] codes
    scales: torch.Tensor  # float32 [2, num_blocks, num_kv_heads]

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
              alloc: Callable[..., torch.Tensor] | None = None) -> QuantKV:
        """Zero codes and scales; `alloc(shape, dtype)` makes the codes (the runner's huge
        pages on CPU)."""
        if dtype not in QMAX:
            raise ValueError(f"no quantized KV format stores {dtype}")
        data = alloc(shape, dtype) if alloc else torch.zeros(shape, dtype=dtype, device=device)
        scales = torch.zeros((2, shape[1], shape[3]), dtype=torch.float32, device=data.device)
        return cls(data, scales)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes of float `x` already divided by its scale: rounded (int8: to nearest, ties to
    even; fp8: torch's cast) and clamped to the format's range."""
    qmax = QMAX[dtype]
    x = x.clamp(-qmax, qmax)
    return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)


def store_kv_quant(key: torch.Tensor, value: torch.Tensor, kv: QuantKV,
                   slot_mapping: torch.Tensor) -> None:
    """Quantize key/value `[T, kv_heads, head_dim]` into their slots (< 0 skipped), raising
    and requantizing the scale of any (block, head) a new row outgrows (module docstring).
    Rows of one call that share a block are taken together: the block's scale covers them all."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    block_size = kv.data.shape[2]
    blocks = slots // block_size
    fresh = blocks[slots % block_size == 0]
    for half, x in ((0, key), (1, value)):
        _store_half(x.float(), kv.data[half], kv.scales[half], slots, blocks, fresh)


def _store_half(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                blocks: torch.Tensor, fresh: torch.Tensor) -> None:
    """One of K or V: `data` `[num_blocks, block_size, heads, dim]`, `scales` `[num_blocks,
    heads]`."""
    if fresh.numel():
        scales.index_fill_(0, fresh, 0.0)
    old = scales.index_select(0, blocks)  # [T, heads]
    need = x.abs().amax(dim=-1) / QMAX[data.dtype]
    scales.scatter_reduce_(0, blocks.unsqueeze(1).expand_as(need), need, "amax")
    new = scales.index_select(0, blocks)
    grow = (new > old) & (old > 0)
    raw = data.view(torch.uint8)  # indexed copies of fp8 are not implemented: move bytes
    if bool(grow.any()):  # requantize the block's codes of that head to the larger scale
        t, h = grow.nonzero(as_tuple=True)
        b = blocks[t]
        ratio = (old[t, h] / new[t, h])[:, None, None]
        codes = raw[b, :, h].view(data.dtype).float() * ratio
        raw[b, :, h] = encode(codes, data.dtype).view(torch.uint8)
    inv = torch.where(new > 0, 1.0 / new.clamp_min(1e-30), torch.zeros_like(new))
    codes = encode(x * inv.unsqueeze(-1), data.dtype).view(torch.uint8)
    raw.view(-1, data.shape[2], data.shape[3]).index_copy_(0, slots, codes)


def dequantize(kv: QuantKV, blocks: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float cache `[2, n, block_size, kv_heads, head_dim]` of `blocks` (all: None), in
    `dtype` (the products are computed in float32, then cast once)."""
    data, scales = kv.data, kv.scales
    if blocks is not None:
        data = data.view(torch.uint8).index_select(1, blocks).view(data.dtype)
        scales = scales.index_select(1, blocks)
    return _times(data, scales[:, :, None, :, None]).to(dtype)


# float8_e4m3fn -> float32 of every byte: torch's own fp8 cast is a slow scalar loop on CPU,
# a table lookup several times faster (and exact: the table is that cast, done once).
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _times(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `codes x scale`, by each format's fastest widening on CPU: int8 through the
    multiply's own type promotion (one pass; `codes.float()` first is ~10x slower), e4m3
    through a lookup table, e5m2 by its cast (an fp16 with the low byte zero: cheap)."""
    if codes.dtype == torch.int8:
        return codes * scale
    if codes.dtype == torch.float8_e4m3fn:
        index = codes.view(torch.uint8).reshape(-1).int()
        table = _E4M3.to(codes.device)
        return table.index_select(0, index).view(codes.shape) * scale
    return codes.float() * scale
