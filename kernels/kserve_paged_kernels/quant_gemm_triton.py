"""Dequantize-in-the-loop GEMMs for quantized checkpoints on CUDA, in Triton: `x @ w.T` where
`w` stays as the checkpoint stores it and is expanded tile by tile in registers.

- `int4_gemm`: AWQ's and GPTQ's 4-bit layouts (engine/kserve_paged_engine/model_executor/quantization/int4_checkpoints.py says
  what each stores), `w = (q - z) s` per group of input features, with GPTQ's `g_idx` read per
  input row, so activation-order checkpoints need no permutation.
- `fp8_gemm`: e4m3/e5m2 weights `[out, in]` with one scale for the tensor, one per output
  channel (what llm-compressor and vLLM's `fp8` write), or one per `[bn, bk]` tile of weights
  (vLLM's block-quantized fp8, `weight_block_size`, e.g. [128, 128]); a block's K side is a
  multiple of BLOCK_K, so each K step reads one scale column.

A program owns a BLOCK_M x BLOCK_N tile of the output and walks K; weights are dequantized to
float32, then rounded to the activations' dtype before `tl.dot` (as a dequantize-then-matmul
in that dtype would), with float32 accumulation; float32 activations get exact (non-TF32)
dots, and so do bf16 ones in the CPU interpreter, whose bf16 `tl.dot` is wrong
(`triton_backend._f32_dot`). Without CUDA the tests
run these in Triton's interpreter against the dequantized weight (tests/kernels/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kserve_paged_kernels.triton_backend import _f32_dot

__all__ = ["fp8_gemm", "int4_gemm"]

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _nibble(j):
    """AWQ's nibble for output column j (mod 8): columns 0, 2, 4, 6 then 1, 3, 5, 7."""
    return (j // 2) + 4 * (j % 2)


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_xm,
                      stride_qw, stride_qz, stride_s, stride_om, zero_offset,
                      AWQ: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if AWQ:
        col_shift = _nibble(rn % 8) * 4
    else:
        col_shift = (rn % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        ok = k_ok[:, None] & n_ok[None, :]
        if AWQ:
            words = tl.load(qw_ptr + rk[:, None] * stride_qw + (rn // 8)[None, :], mask=ok,
                            other=0)
            q = (words >> col_shift[None, :]) & 0xF
        else:
            words = tl.load(qw_ptr + (rk // 8)[:, None] * stride_qw + rn[None, :], mask=ok,
                            other=0)
            q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
        g = tl.load(g_ptr + rk, mask=k_ok, other=0)
        zw = tl.load(qz_ptr + g[:, None] * stride_qz + (rn // 8)[None, :], mask=ok, other=0)
        z = ((zw >> col_shift[None, :]) & 0xF) + zero_offset
        s = tl.load(s_ptr + g[:, None] * stride_s + rn[None, :], mask=ok, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        if F32_DOT:  # w rounded as the low-precision dot would read it
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                     stride_om, stride_s, PER_CHANNEL: tl.constexpr, SCALE_BN: tl.constexpr,
                     SCALE_BK: tl.constexpr, F32_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        w8 = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE_BK > 0:  # block scales: this K step's column of the scale grid
            tile = tl.load(scale_ptr + (rn // SCALE_BN) * stride_s + k0 // SCALE_BK,
                           mask=n_ok, other=0.0).to(tl.float32)
            w = w8.to(tl.float32) * tile[None, :]
        else:
            w = w8.to(tl.float32) * scale
        if F32_DOT:  # w rounded as the low-precision dot would read it
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
              scales: torch.Tensor, g_idx: torch.Tensor, *, awq: bool,
              zero_offset: int = 0) -> torch.Tensor:
    """`x [M, K] @ w.T` for an AWQ (`qweight [K, N / 8]`) or GPTQ (`qweight [K / 8, N]`) weight;
    `g_idx [K]` (int32) is each input row's group, `zero_offset` is added to stored zeros."""
    m, k = x.shape
    n = scales.shape[1]
    if k % 8 or n % 8 or g_idx.shape != (k,):
        raise ValueError(f"int4 GEMM needs K and N multiples of 8 and g_idx [K] (K={k}, N={n})")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _int4_gemm_kernel[_grid(m, n)](
        x, qweight, qzeros, scales, g_idx, out, m, n, k, x.stride(0), qweight.stride(0),
        qzeros.stride(0), scales.stride(0), out.stride(0), zero_offset, AWQ=awq,
        F32_DOT=_f32_dot(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None = None) -> torch.Tensor:
    """`x [M, K] @ (weight * scale).T` for an fp8 `weight [N, K]` and a float `scale` of one
    element (per tensor), N (per output channel) or, with `block` (bn, bk), one per tile:
    `[ceil(N / bn), ceil(K / bk)]`, bk a multiple of BLOCK_K."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block or (1, 0)
    grid = (-(-n // bn), -(-k // bk)) if block else None
    if weight.shape[1] != k or (scale.numel() not in (1, n) if grid is None else (
            tuple(scale.shape) != grid or bk % BLOCK_K)):
        raise ValueError(f"fp8 GEMM: weight {tuple(weight.shape)}, scale {tuple(scale.shape)} "
                         f"(block {block}) for x [{m}, {k}]")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _fp8_gemm_kernel[_grid(m, n)](
        x, weight, scale.contiguous(), out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), scale.shape[-1] if grid else 0,
        PER_CHANNEL=grid is None and scale.numel() == n and n > 1, SCALE_BN=bn, SCALE_BK=bk,
        F32_DOT=_f32_dot(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
