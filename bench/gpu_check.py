"""Paged-decode attention bandwidth on the GPU (the `attention-bw` stage of
bench/gpu_acceptance.py; the kernels' correctness is its `kernel-tests` stage).

    python bench/gpu_check.py [--out PATH] [--contexts 512,4096] [--json] [--dry-run]

1. Device copy bandwidth (a large device-to-device copy, GB/s counted as bytes read + written).
2. Paged decode (q_len 1) for a Llama-3-8B-like layer (32 query heads, 8 KV heads, head_dim 128,
   bf16, block 16) at batch 1/16/64/256 x context 512/4k/16k, timed with
   `triton.testing.do_bench`: achieved GB/s (K/V bytes read + q/out), fraction of copy
   bandwidth; the same kernel on contiguous KV (identity block tables) and torch SDPA on
   contiguous tensors, and the paged overhead ratios.
Writes JSON to --out (default $OUT/gpu_check.json when OUT is set) and prints a markdown table.
Sized for well under 5 minutes on an H200 (one layer; 256 x 16k bf16 K/V is 17 GB).

`--dry-run` runs everything at tiny sizes on CPU (Triton interpreter, wall-clock timer) so the
plumbing can be checked without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="paged-decode attention bandwidth on the GPU")
    default_out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") \
        else None
    parser.add_argument("--out", default=default_out, help="JSON result path")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths")
    parser.add_argument("--json", action="store_true", help="the result as stdout's last line")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on CPU (Triton interpreter) to check the plumbing")
    return parser.parse_args(argv)


def sizes(dry_run: bool, contexts: str | None) -> tuple[int, tuple[int, ...], tuple[int, ...],
                                                        tuple[int, int, int, int]]:
    """(copy bytes, batches, contexts, (heads, kv heads, head dim, block size)): the 8B layer
    on the GPU, a tiny one in the dry run; `--contexts` replaces the contexts only."""
    if dry_run:
        copy_bytes, batches, chosen, shape = 64 << 20, (1, 2), (48, 100), (4, 2, 64, 16)
    else:
        copy_bytes, batches, chosen = 4 << 30, BATCHES, CONTEXTS
        shape = (HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    if contexts:
        chosen = tuple(int(c) for c in contexts.split(","))
    return copy_bytes, batches, chosen, shape


def make_timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: do_bench on CUDA, a median wall clock on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=40))

    def cpu_timer(fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[1] * 1e3

    return cpu_timer


def copy_bandwidth(device: str, timer: Callable, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write bytes)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_decode(device: str, timer: Callable, batches: tuple[int, ...],
                 contexts: tuple[int, ...], shape: tuple[int, int, int, int],
                 copy_gbs: float) -> list[dict]:
    """Paged vs contiguous decode timings; one row per (batch, context)."""
    import torch
    import torch.nn.functional as F

    from kserve_paged_kernels import paged_attention

    heads, kv_heads, head_dim, block = shape
    dtype = torch.bfloat16
    backend = "triton"
    num_blocks = max(batches) * -(-max(contexts) // block)
    kv_cache = torch.empty(2, num_blocks, block, kv_heads, head_dim, dtype=dtype,
                           device=device).normal_()
    elem = kv_cache.element_size()
    scale = head_dim ** -0.5
    rows = []
    for batch in batches:
        for ctx in contexts:
            nblk = -(-ctx // block)
            used = batch * nblk
            perm = torch.randperm(num_blocks, device=device)[:used].int().view(batch, nblk)
            ident = torch.arange(used, device=device, dtype=torch.int32).view(batch, nblk)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
            query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)

            def run(table: torch.Tensor, q=query, sl=seq_lens, qs=qsl, c=ctx) -> torch.Tensor:
                return paged_attention(q, kv_cache, table, sl, qs, scale, backend=backend,
                                       max_seq_len=c, max_query_len=1)

            ms_paged = timer(lambda t=perm: run(t))
            ms_ident = timer(lambda t=ident: run(t))
            # Contiguous K/V for SDPA: the identity-table blocks, viewed [b, kvh, ctx, d].
            kv = kv_cache[:, :used].reshape(2, batch, nblk * block, kv_heads, head_dim)
            k = kv[0, :, :ctx].transpose(1, 2).contiguous()
            v = kv[1, :, :ctx].transpose(1, 2).contiguous()
            q4 = query.unsqueeze(2)  # [b, h, 1, d]
            ms_sdpa = timer(lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
                q4, k, v, scale=scale, enable_gqa=True))
            nbytes = 2 * batch * ctx * kv_heads * head_dim * elem + 2 * query.numel() * elem
            gbs = nbytes / (ms_paged * 1e-3) / 1e9
            rows.append({
                "batch": batch, "context": ctx, "paged_ms": round(ms_paged, 4),
                "paged_GBs": round(gbs, 1), "frac_copy_bw": round(gbs / copy_gbs, 3),
                "identity_ms": round(ms_ident, 4), "sdpa_contig_ms": round(ms_sdpa, 4),
                "overhead_vs_identity": round(ms_paged / ms_ident, 3),
                "overhead_vs_sdpa": round(ms_paged / ms_sdpa, 3),
            })
            print(f"  b={batch:4d} ctx={ctx:6d}: {ms_paged:.4f} ms, {gbs:.0f} GB/s", flush=True)
    return rows


def markdown_table(rows: list[dict], copy_gbs: float) -> str:
    """The decode rows as a markdown table (plus the copy bandwidth line)."""
    head = ("| batch | context | paged ms | GB/s | of copy BW | identity ms | SDPA contig ms "
            "| paged/identity | paged/SDPA |")
    lines = [f"Device copy bandwidth: {copy_gbs:.0f} GB/s", "", head,
             "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['paged_ms']:.4f} | {r['paged_GBs']:.0f} "
            f"| {100 * r['frac_copy_bw']:.0f}% | {r['identity_ms']:.4f} "
            f"| {r['sdpa_contig_ms']:.4f} | {r['overhead_vs_identity']:.2f} "
            f"| {r['overhead_vs_sdpa']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before kserve_paged_kernels.triton_backend is imported
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    result: dict = {"dry_run": args.dry_run, "device": device, "python": platform.python_version(),
                    "torch": torch.__version__}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError as exc:
        result["triton"] = f"unavailable: {exc}"
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    from kserve_paged_kernels import resolve_backend

    result["default_backend"] = resolve_backend(device, block_size=BLOCK, head_dim=HEAD_DIM,
                                                dtype=torch.bfloat16)
    print(f"# kernels GPU check ({'dry run, ' if args.dry_run else ''}{device})", flush=True)

    timer = make_timer(device)
    copy_bytes, batches, contexts, shape = sizes(args.dry_run, args.contexts)
    copy_gbs = copy_bandwidth(device, timer, copy_bytes)
    result["copy_GBs"] = round(copy_gbs, 1)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    result["shape"] = dict(zip(("heads", "kv_heads", "head_dim", "block_size"), shape))
    result["decode"] = bench_decode(device, timer, batches, contexts, shape, copy_gbs)
    table = markdown_table(result["decode"], copy_gbs)
    print()
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
