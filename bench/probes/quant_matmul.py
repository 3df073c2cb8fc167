"""Decode-sized rows through the quantized matmuls against float `F.linear` and the native fp32
GEMM, at SmolLM2-135M's projection shapes and its LM head: our native int4 g32 and int8 g32
(Q8_0) kernels with float32 activations, PyTorch's packed int4 and per-channel int8 kernels in
float32 and bfloat16. Then the weight error of serving Q8_0 per channel (PyTorch's int8 kernel)
instead of group-wise (ours), on the default model's own Q8_0 embedding.

    python bench/probes/quant_matmul.py [--rows 1 4 64] [--no-aten]

Prints milliseconds per call (best of 30 after one warm-up) and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_kernels import cpu_native  # noqa: E402
from kserve_paged_kernels import quant_linear as ql  # noqa: E402

SHAPES = [(1728, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, gate/up, down, LM head


def ms(fn: Callable[[], object], n: int = 30) -> float:
    """Best milliseconds of n calls after one warm-up: on a shared machine a call whose thread
    was descheduled costs a scheduler slice (~20 ms), so the median says more of the load than
    of the kernel."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def native_row(out_f: int, in_f: int, rows: int) -> str:
    w = torch.randn(out_f, in_f) * 0.05
    codes, scale, minimum = ql.quantize_int4(w, 32)
    q4 = ql.pack_int4(codes, scale, minimum, 32, torch.float32)
    q8 = ql.pack_int8(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8),
                      torch.rand(out_f, in_f // 32) * 1e-3, 32, torch.float32)
    x = torch.randn(rows, in_f)
    packed = cpu_native.pack_gemm_weight(w)
    times = {"int4 g32": ms(lambda: ql.int4_mm(x, q4)), "int8 g32": ms(lambda: ql.int8_mm(x, q8)),
             "fp32 native": ms(lambda: cpu_native.gemm(x, packed, out_f)),
             "F.linear fp32": ms(lambda: torch.nn.functional.linear(x, w))}
    return ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())


def aten_row(out_f: int, in_f: int, rows: int, dtype: torch.dtype) -> str:
    w = torch.randn(out_f, in_f) * 0.05
    codes, scale, minimum = ql.quantize_int4(w, 32)
    native = ql.native_for
    ql.native_for = lambda dtype: False  # PyTorch's kernels even in float32
    try:
        q4 = ql.pack_int4(codes, scale, minimum, 32, dtype)
        q8 = ql.quantize_int8(w, dtype)
    finally:
        ql.native_for = native
    x = torch.randn(rows, in_f).to(dtype)
    return (f"aten int4 {ms(lambda: ql.int4_mm(x, q4)):.3f} ms, aten int8 per-channel "
            f"{ms(lambda: ql.int8_mm(x, q8)):.3f} ms")


def q8_error() -> None:
    """Max weight error of per-channel re-quantization of the default model's Q8_0 embedding
    (group-wise: 0, the blocks' own codes and scales)."""
    import gguf

    from kserve_paged_engine.frontend.default_model import find_gguf
    from kserve_paged_engine.model_executor.quantization import gguf_blocks

    path = find_gguf()
    if path is None:
        print("no default GGUF found: skipping the weight error")
        return
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    codes, scale = gguf_blocks.int8_groups(tensor.data, rows, cols)
    w = torch.from_numpy(codes).float() * torch.from_numpy(scale).repeat_interleave(32, 1)
    exact = ql.dequant(ql.pack_int8(torch.from_numpy(codes), torch.from_numpy(scale), 32,
                                    torch.float32))
    requant = ql.dequant(ql.quantize_int8(w, torch.float32))
    print(f"Q8_0 token_embd [{rows}, {cols}] max |w| {float(w.abs().max()):.4f}: group-wise "
          f"max error {float((exact - w).abs().max()):.3g}, per-channel re-quantized max error "
          f"{float((requant - w).abs().max()):.3g} (mean {float((requant - w).abs().mean()):.3g})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--no-aten", action="store_true")
    args = ap.parse_args()
    for rows in args.rows:
        for out_f, in_f in SHAPES:
            print(f"[{out_f}, {in_f}] x {rows} rows: {native_row(out_f, in_f, rows)}")
            if not args.no_aten:
                for dtype in (torch.float32, torch.bfloat16):
                    print(f"    {str(dtype)[6:]}: {aten_row(out_f, in_f, rows, dtype)}")
    q8_error()
    print("loadavg", os.getloadavg(), "threads", torch.get_num_threads())


if __name__ == "__main__":
    main()
