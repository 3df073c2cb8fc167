"""The fp32 FMA peak of this machine, on 1 and on all threads (AVX-512).

A probe for BENCHMARKS.md: the ceiling that the GEMM figures there are compared with. Builds
`fma_peak.c` (12 independent chains of 512-bit fused multiply-adds per thread) and runs it.

    python bench/probes/fma_peak.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "fma_peak"
        subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(HERE / "fma_peak.c"),
                        "-o", str(exe)], check=True)
        for threads in sorted({1, os.cpu_count() or 1}):
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            subprocess.run([str(exe)], check=True, env=env)


if __name__ == "__main__":
    main()
