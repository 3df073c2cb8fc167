"""W8A8 and fp8 candidates on CPU against the weight-only int8 kernels and the float linear,
per projection shape and row count, interleaved in one run (ratios to fp32 `F.linear`).

`python bench/probes/w8a8_ops.py [--threads 2] [--repeats 5]`. Why: issue 34 asks which
PyTorch op serves dynamic int8 activations x int8 weights best here, and how fp8 weights can
stay one byte on CPU (`torch._scaled_mm`, our native kernel decoding e4m3). A probe, not a
benchmark of record.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kserve_paged_kernels import cpu_native, quant_linear
from kserve_paged_kernels.int8_dynamic import quantize_rows

SHAPES = ((1536, 576), (576, 1536), (8192, 2048))


def _time(fn: Callable[[], object], budget: float = 0.15) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def candidates(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    n, k = w.shape
    scale = w.abs().amax(1) / 127
    codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    xb, wb = x.bfloat16(), w.bfloat16()
    native8 = quant_linear.pack_int8(codes, scale[:, None], k, torch.float32)
    aten8 = quant_linear.pack_int8(codes, scale[:, None], k, torch.bfloat16)
    packed32 = cpu_native.pack_gemm_weight(w)
    wt = codes.t().contiguous()
    qw = torch.ops.onednn.qlinear_prepack(codes, [x.shape[0], k])
    zp = torch.zeros(n, dtype=torch.int64)
    one, zero = torch.tensor(1.0), torch.tensor(128, dtype=torch.int64)
    wq = torch.quantize_per_channel(w, scale.double(), zp, 0, torch.qint8)
    torch.backends.quantized.engine = "x86"
    dyn = torch.ops.quantized.linear_prepack(wq, None)
    w8 = (w / (w.abs().amax() / 448)).to(torch.float8_e4m3fn)
    s8 = w.abs().amax().reshape(()) / 448
    fp8_native = quant_linear.pack_fp8(w8, s8.expand(n).contiguous(), None)

    def int_mm() -> torch.Tensor:
        q, s = quantize_rows(x)
        return torch._int_mm(q, wt).float() * s * scale

    def onednn() -> torch.Tensor:
        q, s = quantize_rows(x, shifted=True)  # u8 x s8, the form VNNI multiplies
        out = torch.ops.onednn.qlinear_pointwise.tensor(
            q, one, zero, qw, scale, zp, None, 1.0, 0, torch.float32, "none", [], "")
        return out * s

    def scaled_mm() -> torch.Tensor:
        xs = x.abs().amax() / 448
        return torch._scaled_mm((x / xs).to(torch.float8_e4m3fn), w8.t(), scale_a=xs,
                                scale_b=s8, out_dtype=torch.float32)

    fns = {"fp32 F.linear": lambda: F.linear(x, w),
            "fp32 native gemm": lambda: cpu_native.gemm(x, packed32, n, None),
            "bf16 F.linear": lambda: F.linear(xb, wb),
            "w8 native (fp32 acts)": lambda: quant_linear.matmul(x, native8),
            "w8 aten (bf16 acts)": lambda: quant_linear.matmul(xb, aten8),
            "w8a8 _int_mm": int_mm, "w8a8 onednn qlinear": onednn,
            "w8a8 quantized.linear_dynamic": lambda: torch.ops.quantized.linear_dynamic(x, dyn),
            "fp8 native (e4m3, fp32 acts)": lambda: quant_linear.matmul(x, fp8_native),
            "fp8 _scaled_mm": scaled_mm,
            "fp8 dequantized per call": lambda: F.linear(x, w8.float() * s8)}
    if n * k > 2**21:  # reference-speed paths here (seconds a call at 8192 x 2048)
        for slow in ("w8a8 quantized.linear_dynamic", "fp8 _scaled_mm"):
            del fns[slow]
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        for m in (1, 16, 256):
            fns = candidates(torch.randn(m, k), w)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    times[name].append(_time(fn))
            base = statistics.median(times["fp32 F.linear"])
            print(f"N={n} K={k} M={m}: fp32 F.linear {base * 1e6:.1f} us")
            for name, ts in times.items():
                t = statistics.median(ts)
                print(f"  {name:32s} {t * 1e6:9.1f} us  x{base / t:5.2f}")


if __name__ == "__main__":
    main()
