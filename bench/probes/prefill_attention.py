"""Prefill attention on CPU: the per-row kernel against the transposed-key path for runs.

A probe for BENCHMARKS.md (not part of the engine). It builds the native library
(`kernels/kserve_paged_kernels/csrc`, the sources `kserve_paged_kernels.cpu_native.loader` builds) twice, as shipped and with the transposed-key path for prefill runs turned off
(`-DKT_MIN_ROWS=huge`: every row through the per-row loop), and times one layer's attention
for prefill chunks of SmolLM2's shape (9 query heads over 3 KV heads of 64, fp32, blocks of 16
in shuffled order), the two libraries alternating so machine drift hits both alike.

    python bench/probes/prefill_attention.py [threads]
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kserve_paged_kernels.cpu_native import abi, isa, loader  # noqa: E402

CASES = {
    "W1 prefill step (7 prompts, 64-512)": [512, 400, 300, 200, 100, 64, 472],
    "one 2048-token prompt": [2048],
    "eight 64-token prompts": [64] * 8,
}


def build(tmp: Path, name: str, defines: list[str]) -> ctypes.CDLL:
    out = tmp / f"{name}.so"
    subprocess.run(["gcc", *loader.flags_for(isa.current()), *defines, *map(str, loader.SOURCES), "-o", str(out),
                    "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    abi.declare(lib)
    return lib


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"per-row kernel": build(Path(tmp), "rows", ["-DKT_MIN_ROWS=1000000000"]),
                "transposed keys": build(Path(tmp), "kt", [])}
        bs = 16
        for label, lens in CASES.items():
            nb = [-(-n // bs) for n in lens]
            total = sum(nb) + 4
            kv = torch.randn(2, total, bs, 3, 64)
            perm = torch.randperm(total)
            tables = torch.zeros(len(lens), max(nb), dtype=torch.int32)
            start = 0
            for i, n in enumerate(nb):
                tables[i, :n] = perm[start:start + n]
                start += n
            t = sum(lens)
            q = torch.randn(t, 9, 64)
            row_lens = torch.cat([torch.arange(1, n + 1) for n in lens]).int()
            seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).long()
            tok = torch.arange(t)
            times: dict[str, list[float]] = {k: [] for k in libs}
            outs = {}
            for _ in range(7):
                for name, lib in libs.items():
                    lib.kp_set_threads(threads)
                    out = torch.empty_like(q)
                    t0 = time.perf_counter()
                    rc = lib.kp_paged_rows_f32(
                        q.data_ptr(), q.stride(0), kv.data_ptr(), total, bs, 3, 64, 9,
                        tables.data_ptr(), tables.stride(0), row_lens.data_ptr(), tok.data_ptr(),
                        seq.data_ptr(), t, 0.125, 0, 0.0, out.data_ptr(), out.stride(0))
                    times[name].append(time.perf_counter() - t0)
                    assert rc == 0
                    outs[name] = out
            diff = (outs["per-row kernel"] - outs["transposed keys"]).abs().max().item()
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"{label}: per-row {med['per-row kernel'] * 1e3:.2f} ms, transposed keys "
                  f"{med['transposed keys'] * 1e3:.2f} ms "
                  f"({med['per-row kernel'] / med['transposed keys']:.2f}x), max diff {diff:.1e}")


if __name__ == "__main__":
    main()
