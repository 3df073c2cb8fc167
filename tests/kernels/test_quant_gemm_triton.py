"""The Triton dequantize-in-the-loop GEMMs (kernels/kserve_paged_kernels/quant_gemm_triton.py) against a matmul with
the dequantized weight. Without CUDA they run in Triton's interpreter, in one child process
(tests/kernels/interpreted.py); the weights are packed by tests/helpers/int4_packing.py from
the formats' definitions.

Tolerances. float32 activations: the kernel multiplies the same float32 weight the reference
does, in another summation order: atol 1e-4 on O(1) outputs of <= 96-term sums. bf16: both
sides round the dequantized weight to bf16 and accumulate in float32, so what differs is the
summation order and the output's final bf16 rounding: rtol 1.6e-2 (two bf16 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.int4_packing import checkpoint_parts
from tests.kernels.interpreted import DEVICE, run_calls

GROUP = 32
# (layout, rows M, in K, out N, activation order, dtype): N not a multiple of the 64-wide tile.
INT4_CASES = [("awq", 1, 64, 40, False, torch.float32), ("awq", 5, 96, 72, False, torch.bfloat16),
              ("gptq", 33, 64, 40, False, torch.float32), ("gptq", 3, 96, 48, True, torch.float32),
              ("gptq", 17, 64, 40, True, torch.bfloat16)]
# (format, scales: "channel", "tensor" or a block (bn, bk), dtype, out N, in K): blocks of
# vLLM's [128, 128] and a small [16, 32], both with a partial last row of tiles.
FP8_CASES = [(torch.float8_e4m3fn, "channel", torch.float32, 40, 64),
             (torch.float8_e4m3fn, "tensor", torch.bfloat16, 40, 64),
             (torch.float8_e5m2, "channel", torch.float32, 40, 64),
             (torch.float8_e4m3fn, (128, 128), torch.float32, 200, 256),
             (torch.float8_e4m3fn, (16, 32), torch.bfloat16, 40, 96)]


def _int4_case(layout: str, m: int, k: int, n: int, act_order: bool, dtype: torch.dtype
               ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g) * 0.2
    g_idx = torch.arange(k) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    parts, deq = checkpoint_parts(w, g_idx, layout)
    x = torch.randn(m, k, generator=g).to(dtype)
    kw = {"qweight": parts["qweight"], "qzeros": parts["qzeros"],
          "scales": parts["scales"], "g_idx": g_idx.to(torch.int32),
          "awq": layout == "awq", "zero_offset": 0 if layout == "awq" else 1}
    return kw, x, deq


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    if x.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), x @ w.t(), atol=1e-4, rtol=1e-5)
    else:
        want = (x.float() @ w.to(x.dtype).float().t()).to(x.dtype)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1.6e-2)


def test_int4_gemm_equals_the_dequantized_matmul(tmp_path: Path) -> None:
    cases = [_int4_case(*c) for c in INT4_CASES]
    calls = [("kserve_paged_kernels.quant_gemm_triton", "int4_gemm",
              (x.to(DEVICE), kw.pop("qweight").to(DEVICE), kw.pop("qzeros").to(DEVICE),
               kw.pop("scales").to(DEVICE), kw.pop("g_idx").to(DEVICE)), kw)
             for kw, x, _ in cases]
    results = run_calls(calls, tmp_path)
    for (got, _), (_, x, deq) in zip(results, cases, strict=True):
        _check(got, x, deq)  # the checkpoint's fp16 scales, read as they are


def _fp8_case(fmt: torch.dtype, per: str | tuple[int, int], dtype: torch.dtype, n: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g) * 0.3
    if isinstance(per, tuple):  # one scale per [bn, bk] tile (max |w| of the tile / 200)
        bn, bk = per
        pad = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        scale = pad.reshape(pad.shape[0] // bn, bn, -1, bk).amax((1, 3)) / 200.0
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    else:
        scale = (w.abs().amax(1) if per == "channel" else w.abs().amax().reshape(1)) / 200.0
        full = scale[:, None] if per == "channel" else scale
    w8 = (w / full).to(fmt)
    kw = {"block": per} if isinstance(per, tuple) else {}
    return torch.randn(6, k, generator=g).to(dtype), w8, scale, w8.float() * full, kw


def test_fp8_gemm_equals_the_dequantized_matmul(tmp_path: Path) -> None:
    cases = [_fp8_case(*c) for c in FP8_CASES]
    results = run_calls([("kserve_paged_kernels.quant_gemm_triton", "fp8_gemm",
                          (x.to(DEVICE), w8.to(DEVICE), s.to(DEVICE)), kw)
                         for x, w8, s, _, kw in cases], tmp_path)
    for (got, _), (x, _, _, deq, _) in zip(results, cases, strict=True):
        _check(got, x, deq)


def test_shapes_it_cannot_read_are_refused_before_launch() -> None:
    pytest.importorskip("triton")
    from kserve_paged_kernels.quant_gemm_triton import fp8_gemm, int4_gemm

    kw, x, _ = _int4_case("gptq", 2, 64, 40, False, torch.float32)
    with pytest.raises(ValueError, match="g_idx"):
        int4_gemm(x, kw["qweight"], kw["qzeros"], kw["scales"], kw["g_idx"][:32], awq=False)
    with pytest.raises(ValueError, match="fp8 GEMM"):
        fp8_gemm(x, torch.zeros(40, 32, dtype=torch.float8_e4m3fn), torch.ones(1))
    with pytest.raises(ValueError, match="fp8 GEMM"):  # a scale grid of the wrong shape
        fp8_gemm(x, torch.zeros(40, 64, dtype=torch.float8_e4m3fn), torch.ones(2, 2),
                 block=(128, 128))
