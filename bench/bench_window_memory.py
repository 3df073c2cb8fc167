"""KV memory of models that mix sliding-window and global layers: per-group tables vs one table.

Block accounting only (no model runs, so the figures are deterministic): the engine's scheduler
and KV manager serve 4k-token requests for a Gemma-3-shaped config, once with the sliding
layers in their own KV groups (engine/kserve_paged_engine/core/kv_groups.py) and once with one block table for every
layer (`disable_hybrid_kv_cache_manager`). Printed per layout: KV bytes per block, the blocks
one request holds while decoding (per group) and at its peak (a prefill chunk on top of the
window), and how many such requests a fixed KV budget serves at once: the most decoding
together in a simulated run of `--requests` requests (preemption by recompute when the pool
runs out), and the budget divided by one decoding request's blocks.

    python bench/bench_window_memory.py [--budget-gib 1] [--prompt 4096] [--requests 96]
"""

from __future__ import annotations

import argparse

from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.kv_groups import KVLayout, kv_layout
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.frontend.stop_check import StopCheck
from kserve_paged_engine.sampling_params import SamplingParams

# (name, layers, KV heads, head_dim, window, every n-th layer global): Gemma 3's text configs.
SHAPES = [("gemma-3-270m", 18, 1, 256, 512, 6), ("gemma-3-1b", 26, 1, 256, 512, 6)]


def simulate(layout: KVLayout, num_blocks: int, bs: int, chunk: int, prompt: int, out_len: int,
             n: int) -> tuple[int, int, int, int, int]:
    """(most requests decoding at once, preemptions, blocks one request holds decoding, its
    peak, peak blocks in use)."""
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=False,
                        group_windows=layout.group_windows)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=chunk)
    sched = Scheduler(config, kv, max_model_len=prompt + out_len + 1)
    for i in range(n):
        tokens = [(i * 7919 + j) % 50_000 + 3 for j in range(prompt)]
        sched.add_request(Request(f"r{i}", tokens, SamplingParams(max_tokens=out_len,
                                                                  ignore_eos=True)))
    most = held_decoding = peak_one = peak_used = 0
    while sched.has_unfinished():
        out = sched.schedule()
        peak_one = max([peak_one] + [kv.num_held_blocks(r.request_id) for r in out.scheduled])
        peak_used = max(peak_used, kv.pool.num_used_blocks)
        decoding = [r for r in out.scheduled if r.num_computed_tokens >= r.num_prompt_tokens]
        most = max(most, len(decoding))
        sampled = {r.request_id: 7 for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                   >= r.num_tokens}
        sched.update_from_output(out, StopCheck(sched.max_model_len).check(out, sampled))
        if decoding:
            held_decoding = max(held_decoding, kv.num_held_blocks(decoding[0].request_id))
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    return most, sched.num_preemptions, held_decoding, peak_one, peak_used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=1.0, help="KV cache bytes, GiB")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--dtype-bytes", type=int, default=4, help="4: float32 (CPU), 2: bf16")
    args = ap.parse_args()
    bs = args.block_size
    print(f"workload: {args.requests} requests of {args.prompt} prompt + {args.output} output "
          f"tokens, block size {bs}, chunk {args.chunk}, KV budget {args.budget_gib} GiB, "
          f"{args.dtype_bytes}-byte KV")
    for name, layers, kv_heads, head_dim, window, every in SHAPES:
        windows = [None if (i + 1) % every == 0 else window for i in range(layers)]
        rows = []
        for label, per_group in (("per-group tables", True), ("one shared table", False)):
            layout = kv_layout(windows, per_group)
            per_block = 2 * layout.group_size * kv_heads * head_dim * args.dtype_bytes * bs
            num_blocks = int(args.budget_gib * 2**30) // per_block
            most, preempted, held, peak, _ = simulate(layout, num_blocks, bs, args.chunk,
                                                      args.prompt, args.output, args.requests)
            rows.append((label, layout, per_block, num_blocks, most, preempted, held, peak))
        print(f"\n{name}: {layers} layers ({layers // every} global), window {window}")
        for label, layout, per_block, num_blocks, most, preempted, held, peak in rows:
            mib = held * per_block / 2**20
            print(f"  {label:17s} {layout.num_groups} group(s) x {layout.group_size} layers, "
                  f"{per_block // 1024} KiB/block, {num_blocks} blocks | one decoding request "
                  f"holds {held} blocks ({mib:.1f} MiB), peak {peak} | concurrent decoding "
                  f"{most} (budget / held: {num_blocks // held}), preemptions {preempted}")
        (_, _, _, _, most_g, _, held_g, _), (_, _, pb_s, _, most_s, _, held_s, _) = rows
        ratio = (held_s * pb_s) / (held_g * rows[0][2])
        print(f"  bytes per decoding request: {ratio:.2f}x less with per-group tables; "
              f"concurrent decoding {most_g} vs {most_s}")


if __name__ == "__main__":
    main()
