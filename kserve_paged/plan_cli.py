"""``kserve-paged plan`` (also ``kserve-paged-plan``): the capacity planner's command line.

Reads a model folder's config.json (no weights), prints the plan (kserve_paged/plan.py) and,
with ``--write-overlay DIR``, writes a kustomize overlay carrying it (plan_overlay.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kserve_paged.flag_types import parse_memory
from kserve_paged.plan import GPUS, make_plan, parse_device, render
from kserve_paged.plan_overlay import write_overlay
from kserve_paged.plan_weights import packed_weight_bytes
from kserve_paged_engine.core.kv_sizing import resolve_dtype
from kserve_paged_engine.model_executor.model_facts import describe_folder
from kserve_paged_kernels import kv_formats


def _workload(text: str) -> tuple[int, int]:
    try:
        prompt, out = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workload is prompt:output tokens, got {text!r}") \
            from None
    if prompt < 1 or out < 1:
        raise argparse.ArgumentTypeError(f"--workload tokens must be >= 1, got {text!r}")
    return prompt, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kserve-paged plan", allow_abbrev=False,
                                description="Size a kserve-paged deployment from a config.json.")
    p.add_argument("--model", required=True, help="model folder or its config.json (no weights)")
    p.add_argument("--gpu", required=True, help=f"{', '.join(GPUS)} or cpu:<GiB>")
    p.add_argument("--max_model_len", type=int, default=None)
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1,
                   help="pods the ranks span (multi-node, docs/tensor_parallel.md): "
                        "tensor_parallel_size / nnodes devices per pod")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--kv_cache_dtype", "--kv-cache-dtype", default="auto",
                   choices=kv_formats.KV_CACHE_DTYPES,
                   help="as the server's flag: fp8/int8 store a byte per element (x2 blocks "
                        "against bf16)")
    p.add_argument("--max_num_seqs", type=int, default=None)
    p.add_argument("--max_num_batched_tokens", type=int, default=None)
    p.add_argument("--kv_cache_memory", type=parse_memory, default=None,
                   help="as the server's flag; default: the engine's own sizing rule")
    p.add_argument("--workload", type=_workload, default=None,
                   help="typical request, prompt:output tokens (default 512:128)")
    p.add_argument("--memory_bandwidth", type=float, default=None,
                   help="bytes/s per device, overriding the table (cpu: default 50e9)")
    p.add_argument("--write-overlay", dest="write_overlay", default=None, metavar="DIR",
                   help="write a kustomize overlay with these flags and resources to DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = describe_folder(args.model)
        device = parse_device(args.gpu, args.memory_bandwidth)
        folder = Path(args.model)
        folder = folder.parent if folder.name == "config.json" else folder
        elem = resolve_dtype(args.dtype, torch.device(device.kind)).itemsize
        plan = make_plan(model, device,
                         max_model_len=args.max_model_len, tp=args.tensor_parallel_size,
                         dtype=args.dtype, block_size=args.block_size, workload=args.workload,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_memory=args.kv_cache_memory,
                         kv_cache_dtype=args.kv_cache_dtype,
                         packed_weights=packed_weight_bytes(folder, elem),
                         nnodes=args.nnodes)
    except ValueError as exc:
        parser.error(str(exc))
    print(render(plan, model))
    if args.write_overlay:
        try:
            written = write_overlay(plan, Path(args.write_overlay))
        except ValueError as exc:
            parser.error(str(exc))
        print(f"overlay      {written} (kubectl apply -k {written})")
    return 0
