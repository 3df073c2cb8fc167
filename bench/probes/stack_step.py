"""Decode steps of the default model's one-call decoder stack (the 4-bit GGUF with bf16
activations, or with `--dtype float32` fp32 ones), timed around the native call alone: `--rows` sequences with prompts of 64-448
tokens are prefilled, then one step of one token per sequence.

Two builds of the native library are compared in the same process, call by call (the fairest
A/B on a machine other processes load): the stack of this checkout and the one of `--base`
(another checkout's csrc, built into a temporary directory with the same flags) each run the
same captured decode step `--calls` times, alternating, with the same inputs (the step's KV
writes are idempotent: the same values to the same slots). Printed: each build's median and
best call, the ratio, the process's voluntary and involuntary context switches over the calls
of each build, and whether the two builds' outputs are equal bit for bit.

    OMP_NUM_THREADS=2 python bench/probes/stack_step.py --base /work/main [--rows 48]
        [--calls 200] [--dtype float32]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.benchlib import csrc_of  # noqa: E402
from kserve_paged_engine.frontend.default_model import find_gguf  # noqa: E402
from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_kernels.cpu_native import decoder_stack, isa, loader  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402


def build_from(root: Path, out: Path) -> ctypes.CDLL:
    """`root`'s native sources built for this CPU's level with this checkout's flags."""
    level = isa.current()
    sources = [csrc_of(root) / p.name for p in loader.SOURCES]
    compiler = loader.find_compiler()
    subprocess.run([compiler, *loader.flags_for(level), *map(str, sources), "-o", str(out),
                    "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    for fn in (lib.kp_decoder_stack_bf16, lib.kp_decoder_stack_f32):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.kp_set_threads.argtypes = [ctypes.c_int]
    lib.kp_set_threads.restype = None
    return lib


def prefilled(rows: int, dtype: torch.dtype) -> tuple[torch.nn.Module, PagedSim, dict[int, int]]:
    """The default model at 4 bits in `dtype`, `rows` sequences prefilled, each one's next
    token."""
    gguf = find_gguf()
    assert gguf is not None
    model, _ = load_model(gguf, dtype, torch.device("cpu"), quantization="gguf")
    assert model.native_stack is not None, model.native_stack_declined
    sim = PagedSim(model, seed=0, num_blocks=rows * 30, block_size=16)
    sim.kv = [kv.to(dtype) for kv in sim.kv]
    rng = random.Random(0)
    last = {}
    for sid in range(rows):
        prompt = [rng.randrange(100, 20000) for _ in range(rng.randrange(64, 448))]
        last[sid] = int(sim.step([(sid, prompt)])[-1].argmax())
    return model, sim, last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other checkout's root")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    fn_name = "kp_decoder_stack_bf16" if dtype == torch.bfloat16 else "kp_decoder_stack_f32"
    elem = ctypes.c_uint16 if dtype == torch.bfloat16 else ctypes.c_float
    model, sim, last = prefilled(args.rows, dtype)
    tmp = Path(tempfile.mkdtemp(prefix="stack_step_"))
    libs = {"base": build_from(Path(args.base), tmp / "base.so"),
            "this": build_from(Path(__file__).resolve().parents[2], tmp / "this.so")}
    threads = torch.get_num_threads()
    for lib in libs.values():
        lib.kp_set_threads(threads)
    result: dict[str, object] = {}
    real_loaded = decoder_stack.loaded

    class Proxy:
        """The loaded library, its stack of `dtype` replaced by the interleaved A/B."""

        def __getattr__(self, name: str) -> object:
            if name == fn_name:
                return self.ab
            return getattr(real_loaded(), name)

        def ab(self, m, s) -> int:  # noqa: ANN001
            step = s._obj
            t, hidden = step.tokens, model.native_stack.hidden
            x = torch.frombuffer((elem * (t * hidden)).from_address(step.x), dtype=dtype)
            out = torch.frombuffer((elem * (t * hidden)).from_address(step.out), dtype=dtype)
            x0, outs = x.clone(), {}
            times = {name: [] for name in libs}
            csw = {name: [0, 0] for name in libs}
            for i in range(2 * args.calls):
                name = ("base", "this")[i % 2]
                x.copy_(x0)
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                rc = getattr(libs[name], fn_name)(ctypes.addressof(m._obj),
                                                  ctypes.addressof(step))
                times[name].append(time.perf_counter() - t0)
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                csw[name][0] += ru1.ru_nvcsw - ru0.ru_nvcsw
                csw[name][1] += ru1.ru_nivcsw - ru0.ru_nivcsw
                assert rc == 0, rc
                outs.setdefault(name, out.clone())
                assert torch.equal(out, outs[name]), "a build is not deterministic"
            result.update(times=times, csw=csw, equal=torch.equal(outs["base"], outs["this"]),
                          tokens=t)
            return 0

    decoder_stack.loaded = lambda: Proxy()
    sim.step([(sid, [last[sid]]) for sid in range(args.rows)])
    decoder_stack.loaded = real_loaded
    report(result, threads, args.calls)


def report(result: dict, threads: int, calls: int) -> None:
    """Each build's median and best call, their ratios, context switches, bit equality."""
    times, csw = result["times"], result["csw"]
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    best = {k: 1000 * min(v) for k, v in times.items()}
    print(f"threads={threads} rows={result['tokens']} calls={calls} each, interleaved; "
          f"loadavg {os.getloadavg()[0]:.2f}")
    for k in times:
        print(f"  {k:4s}: median {med[k]:.3f} ms, best {best[k]:.3f} ms, context switches "
              f"voluntary {csw[k][0]} involuntary {csw[k][1]}")
    print(f"  this/base: median {med['this'] / med['base']:.3f}, best "
          f"{best['this'] / best['base']:.3f}; outputs equal bit for bit: {result['equal']}")


if __name__ == "__main__":
    main()
