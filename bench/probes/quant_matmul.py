"""One decode row (M=1) through the quantized matmuls of kernels/quant_linear.py against
float `F.linear`, at SmolLM2-135M's projection shapes and its LM head, in float32 and bfloat16.

    python bench/probes/quant_matmul.py

Prints milliseconds per call (mean of 20 after one warm-up) and the load average.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import quant_linear as ql  # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (49152, 576)]  # gate/up, down, LM head (out, in)


def ms(fn: Callable[[], object], n: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f) * 0.05
        codes, scale, minimum = ql.quantize_int4(w, 32)
        for dtype in (torch.float32, torch.bfloat16):
            x, wd = torch.randn(1, in_f).to(dtype), w.to(dtype)
            q4 = ql.pack_int4(codes, scale, minimum, 32, dtype)
            q8 = ql.quantize_int8(w, dtype)
            t4 = ms(lambda x=x, q4=q4: ql.int4_mm(x, q4))
            t8 = ms(lambda x=x, q8=q8: ql.int8_mm(x, q8))
            tf = ms(lambda x=x, wd=wd: torch.nn.functional.linear(x, wd))
            print(f"[{out_f}, {in_f}] {str(dtype)[6:]}: int4 {t4:.3f} ms, int8 {t8:.3f} ms, "
                  f"F.linear {tf:.3f} ms")
    print("loadavg", os.getloadavg(), "threads", torch.get_num_threads())


if __name__ == "__main__":
    main()
