"""The LoRA delta of a step's rows grouped by adapter, in one native call per projection
(`csrc/lora_sgmv.c`): the CPU counterpart of `kernels/kserve_paged_kernels/lora_triton.py`.

A step's segments (which rows use which slot) are the same for every projection of every
layer, so `LoRASegments` checks and converts them once per step and `lora_sgmv_segments`
does little more than the ctypes call: per projection the Python around the kernel costs
more than the kernel itself at decode sizes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

import torch

from kserve_paged_kernels.cpu_native.abi import LORA_MAX_RANK
from kserve_paged_kernels.cpu_native.loader import load, sync_threads


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.int64).contiguous()


@dataclass(slots=True)
class LoRASegments:
    """One step's segments for the native kernel: segment s is rows[seg_start[s] ..
    + seg_len[s]], using slot seg_slot[s] scaled by scales[slot]."""

    rows: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    scales: torch.Tensor
    lib: ctypes.CDLL

    @classmethod
    def build(cls, rows: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
              seg_slot: torch.Tensor, scales: torch.Tensor) -> LoRASegments | None:
        """None when the library is not loaded."""
        lib = load()
        if lib is None:
            return None
        return cls(_i64(rows), _i64(seg_start), _i64(seg_len), _i64(seg_slot),
                   scales.to("cpu", torch.float32).contiguous(), lib)


def lora_sgmv_segments(x: torch.Tensor, out: torch.Tensor, a_stack: torch.Tensor,
                       b_t: torch.Tensor, segs: LoRASegments) -> Literal[True] | None:
    """out[rows of segment s] += scales[slot] * (x[rows] @ A[slot].T) @ B[slot].T in place;
    `a_stack` `[slots, rank, in]` and `b_t` (B transposed, `[slots, rank, out]`) contiguous.
    None (nothing done) when the tensors are not fp32 CPU rows, the stacks not contiguous or
    the rank outside the kernel's limit; IndexError for a row, segment or slot out of range."""
    f32 = torch.float32
    if not (x.dtype == out.dtype == a_stack.dtype == b_t.dtype == f32) or x.is_cuda:
        return None
    if x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
        return None
    if not (a_stack.is_contiguous() and b_t.is_contiguous()):
        return None
    slots, rank, in_dim = a_stack.shape
    out_dim = b_t.shape[2]
    if not 0 < rank <= LORA_MAX_RANK:
        return None
    if (x.shape[1] != in_dim or out.shape[1] != out_dim or x.shape[0] != out.shape[0]
            or b_t.shape[:2] != (slots, rank) or segs.scales.numel() < slots):
        raise ValueError("x, out, the adapter stacks and the scales disagree on their sizes")
    sync_threads(segs.lib)
    rc = segs.lib.kp_lora_sgmv_f32(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), a_stack.data_ptr(),
        b_t.data_ptr(), segs.scales.data_ptr(), slots, rank, in_dim, out_dim, x.shape[0],
        segs.rows.data_ptr(), segs.rows.numel(), segs.seg_start.data_ptr(),
        segs.seg_len.data_ptr(), segs.seg_slot.data_ptr(), segs.seg_start.numel())
    if rc == -1:
        raise IndexError("a LoRA row, segment or slot is out of range")
    if rc == -3:
        raise MemoryError("native LoRA could not allocate its scratch")
    if rc != 0:
        raise ValueError(f"native LoRA refused its arguments ({rc})")
    return True


def lora_sgmv(x: torch.Tensor, out: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              scales: torch.Tensor, rows: torch.Tensor, seg_start: torch.Tensor,
              seg_len: torch.Tensor, seg_slot: torch.Tensor) -> Literal[True] | None:
    """`kserve_paged_kernels.reference.lora_sgmv_ref`'s arguments (`b_stack` `[slots, out, rank]`) in one
    call: True, or None when the library or the tensors do not fit (see above)."""
    segs = LoRASegments.build(rows, seg_start, seg_len, seg_slot, scales)
    if segs is None or a_stack.dim() != 3 or b_stack.dim() != 3:
        return None
    return lora_sgmv_segments(x, out, a_stack.contiguous(),
                              b_stack.transpose(1, 2).contiguous(), segs)
