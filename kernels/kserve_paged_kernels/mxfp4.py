"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), kept 4-bit in memory.

A row of `cols` values is stored as `cols / 32` groups: 16 bytes of E2M1 codes (two 4-bit
values a byte, the even column in the low nibble; bit 3 the sign, bits 0-2 index
0, 0.5, 1, 1.5, 2, 3, 4, 6) and one E8M0 byte, the group's shared power of two biased by 127.
`blocks` is `[..., rows, cols / 32, 16]` uint8 and `scales` `[..., rows, cols / 32]` uint8, the
released checkpoints' `*_blocks` / `*_scales` tensors as they are.

`linear` multiplies rows by such a weight without a float copy of it (the native CPU kernel,
csrc/mxfp4_gemm.c, or the Triton kernel, mxfp4_triton.py, each decoding inside its loop);
`dequantize` decodes a slice to float: every value is a code times a power of two, so the
decode is exact in float32 and bfloat16 alike (for exponents bfloat16 covers).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per shared exponent
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_luts: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _luts:
        _luts[key] = torch.tensor(E2M1, dtype=dtype, device=device)
    return _luts[key]


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless (blocks, scales) are a uint8 MXFP4 pair of matching groups."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8 (got {blocks.dtype}, "
                         f"{scales.dtype})")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (blocks: [..., groups, 16], scales: "
                         "[..., groups])")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[..., rows, cols]` values of (blocks, scales) in `dtype`."""
    check_shapes(blocks, scales)
    lut = _lut(dtype, blocks.device)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    vals = vals.flatten(-2)  # [..., groups, 32], the even column first
    exp = scales.to(torch.int32) - 127
    return torch.ldexp(vals, exp.unsqueeze(-1).to(dtype)).flatten(-2).to(dtype)


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T + bias` -> `[M, N]` in x's dtype, W's rows as MXFP4 (`blocks [N, K / 32,
    16]`, `scales [N, K / 32]`), never holding a float copy of W: the Triton kernel that decodes
    inside its K loop on CUDA (`mxfp4_triton`; in the interpreter with the triton backend
    forced), the native CPU kernel (`kp_mxfp4_linear_f32`, every level's build; bf16 rows are
    widened and the result rounded once), else W decoded for this call and `F.linear`."""
    from kserve_paged_kernels import fused_ops
    from kserve_paged_kernels.cpu_native.loader import load, sync_threads

    check_shapes(blocks, scales)
    module = fused_ops.triton_module("mxfp4_triton", x.device)
    if module is not None:
        return module.mxfp4_linear_triton(x, blocks, scales, bias)
    n, k = scales.shape[-2], scales.shape[-1] * GROUP
    lib = load() if x.device.type == "cpu" else None
    if (lib is not None and x.dim() == 2 and x.shape[1] == k
            and x.dtype in (torch.float32, torch.bfloat16)):
        xf = x.float() if x.dtype != torch.float32 or x.stride(-1) != 1 else x
        b = None if bias is None else bias.detach().float().contiguous()
        blk, scl = blocks.contiguous(), scales.contiguous()
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        sync_threads(lib)
        rc = lib.kp_mxfp4_linear_f32(xf.data_ptr(), xf.stride(0), xf.shape[0], blk.data_ptr(),
                                     scl.data_ptr(), n, k, None if b is None else b.data_ptr(),
                                     out.data_ptr(), out.stride(0))
        if rc == -2:
            raise MemoryError("native MXFP4 linear could not allocate its scratch")
        if rc == 0:
            return out.to(x.dtype)
    return torch.nn.functional.linear(x, dequantize(blocks, scales, x.dtype), bias)
