"""One decode step of a Llama-3-8B-shaped model under torch.profiler: kernel launches and the
GPU-busy fraction, eagerly and through a CUDA graph (issue 32, item 7).

    python bench/profile_step.py [--tiny] [--batch N] [--json]

The model folder and dummy weights are bench/decode_8b.py's. `--batch` requests (64 by
default) of `PROMPT` tokens are prefilled, then one decode step is profiled eagerly (the graphs
set aside) and one through the captured graph. Per step: the wall time between syncs; the
launches `kserve_paged_kernels.launches` counts (Triton launches and ATen ops); on CUDA the kernels the
profiler saw on the device, the launch calls it saw on the host (`cudaLaunchKernel`,
`cuLaunchKernelEx`, `cudaGraphLaunch`, ...) and the GPU-busy fraction: the union of the device
kernels' intervals over the step's wall time (1.0: the GPU never waited for the host).

Without CUDA (`--tiny` is implied; Triton interpreted, float32, graphs by the recording
stand-in) there is no device timeline: the device fields are null and `measured` says so; the
launch counts and the profiler's CPU op count are still reported. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_8b import LLAMA3_8B, TINY, model_folder  # noqa: E402

PROMPT = 512
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def busy_fraction(intervals: list[tuple[float, float]], wall: float) -> float | None:
    """The share of `wall` covered by the union of `intervals` (same unit)."""
    if wall <= 0:
        return None
    covered, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        covered += hi - max(lo, end)
        end = hi
    return min(covered / wall, 1.0)


def _profiled_step(engine: Any, device: str) -> dict[str, Any]:
    """One engine step under the profiler and the launch counter."""
    from torch.profiler import ProfilerActivity, profile

    from kserve_paged_kernels.launches import counting

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof, counting() as count:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    out: dict[str, Any] = {"wall_ms": wall * 1e3, "launches_counted": count.total,
                           "triton_launches": sum(count.triton.values()),
                           "cpu_ops": sum(1 for e in events if e.device_type.name == "CPU")}
    if device != "cuda":
        out.update(device_kernels=None, launch_calls=None, gpu_busy_fraction=None)
        return out
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    out["device_kernels"] = len(kernels)
    out["launch_calls"] = sum(1 for e in events if e.name.startswith(LAUNCH_CALLS))
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    out["kernel_ms"] = sum(hi - lo for lo, hi in spans) / 1e3
    out["gpu_busy_fraction"] = busy_fraction(spans, wall * 1e6)
    return out


def run(tiny: bool, batch: int) -> dict[str, Any]:
    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.worker.cuda_graphs import CudaCapture, RecordReplay

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = tiny or device == "cpu"
    shape, prompt = (TINY, 8) if tiny else (LLAMA3_8B, PROMPT)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": "tiny" if tiny else "llama3-8b", "batch": batch, "prompt": prompt,
        "layers": shape["num_hidden_layers"],
        "measured": "device timeline (torch.profiler, CUDA)" if device == "cuda" else
        "no CUDA device: device kernels and the GPU-busy fraction are not measured (null); "
        "launches are counted on the host (Triton interpreted, ATen ops)"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(shape, Path(tmp) / "model")
        llm = LLM(model=str(folder), load_format="dummy", device=device,
                  dtype="bfloat16" if device == "cuda" else "float32", enforce_eager=True,
                  max_num_seqs=batch, max_model_len=prompt + 8, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, prompt), block_size=16,
                  kv_cache_memory=(16 << 30) if device == "cuda" else (16 << 20))
        runner, engine = llm.engine.runner, llm.engine
        why = runner.capture_graphs(batch, CudaCapture() if device == "cuda" else RecordReplay())
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"p{i}", {"prompt_token_ids": [2 + (i + j) % 90
                                                              for j in range(prompt)]}, params)
        while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()
        engine.step()  # one decode step unprofiled: the first of anything is not the figure
        graphs, runner.graphs = runner.graphs, None
        out["eager"] = _profiled_step(engine, device)
        runner.graphs = graphs
        out["graphs"] = _profiled_step(engine, device) if graphs is not None else {
            "skipped": f"no graphs: {why}"}
        engine.abort_request([f"p{i}" for i in range(batch)])
    eager = out["eager"]
    if eager["device_kernels"] is not None:  # the whole step (sampling too) over the layers
        eager["device_kernels_per_layer"] = eager["device_kernels"] / out["layers"]
    out["ok"] = eager["launches_counted"] > 0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="decode rows (64; tiny: 2)")
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
        # Plain F.linear, as on the GPU: the native CPU GEMM and oneDNN packing are not counted.
        os.environ.update(KSERVE_PAGED_NATIVE="0", KSERVE_PAGED_ONEDNN="0")
    tiny = args.tiny or not torch.cuda.is_available()
    result = run(tiny, args.batch or (2 if tiny else 64))
    if not args.json:
        for mode in ("eager", "graphs"):
            print(f"{mode}: {result[mode]}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
