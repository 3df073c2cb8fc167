"""Paged attention over a KV cache of more than 2^31 elements (issue 32, item 7).

    python bench/big_kv_check.py [--tiny] [--json]

On CUDA: a bf16 cache `[2, blocks, 16, 8, 128]` with more than 2^31 elements (about 4.3 GB),
every sequence's blocks drawn from its far end (offsets past 2^31, where int32 offset
arithmetic would wrap). One varlen step mixes decodes of short and long contexts, a chunked
prefill (new tokens over a cached part), two sequences sharing their leading blocks (a prefix
hit) and padded rows (slot -1, past `query_start_loc[-1]`); the new keys and values go in with
the Triton store, then attention runs with the split count forced to 1, 4 and 32. Every real
row must match `kserve_paged_kernels.reference.paged_attention_ref` (bf16 bound 2e-2; fp32 1e-4), padded
rows must be exactly zero, and the store must have written every real slot and no other.
`--tiny` (and any run without CUDA, Triton interpreted) does the same at a small size. The last
stdout line is JSON; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIG = dict(block_size=16, kv_heads=8, heads=32, head_dim=128, dtype=torch.bfloat16,
           min_elements=2**31 + 2**20, bound=2e-2)
TINY = dict(block_size=4, kv_heads=2, heads=4, head_dim=16, dtype=torch.float32,
            min_elements=0, bound=1e-4)


def step(blocks_total: int, block_size: int, g: torch.Generator) -> dict:
    """The step's sequences: (q_len, seq_len) and block tables from the cache's far end."""
    shapes = [(1, 5), (1, 37), (1, 40 * block_size + 3), (9, 9), (7, 30), (1, 20), (3, 20)]
    need = [-(-s // block_size) for _, s in shapes]
    top = torch.randperm(sum(need) + 8, generator=g) + (blocks_total - sum(need) - 8)
    tables, used = [], 0
    for n in need:
        tables.append(top[used:used + n].tolist())
        used += n
    shared = -(-12 // block_size) - 1  # sequences 5 and 6: one prompt's first 12 tokens
    tables[6][:shared] = tables[5][:shared]
    width = max(need)
    table = torch.zeros(len(shapes), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q_lens = [q for q, _ in shapes]
    seq_lens = [s for _, s in shapes]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    slots = []
    for (q, s), t in zip(shapes, tables):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    return {"table": table, "q_lens": q_lens, "seq_lens": seq_lens, "starts": starts,
            "slots": slots, "used": sorted({b for t in tables for b in t})}


def run(tiny: bool) -> dict:
    from kserve_paged_kernels.reference import paged_attention_ref
    from kserve_paged_kernels.triton_backend import paged_attention_triton, store_kv_triton

    cfg = TINY if tiny else BIG
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bs, kvh, hd, dtype = cfg["block_size"], cfg["kv_heads"], cfg["head_dim"], cfg["dtype"]
    per_block = 2 * bs * kvh * hd
    blocks = max(cfg["min_elements"] // per_block + 1, 128)
    g = torch.Generator().manual_seed(0)
    kv = torch.empty(2, blocks, bs, kvh, hd, dtype=dtype, device=device)
    s = step(blocks, bs, g)
    used = torch.tensor(s["used"], device=device)
    kv[:, used] = torch.randn(2, used.numel(), bs, kvh, hd, generator=g).to(device, dtype)
    padded = 3
    total = s["starts"][-1] + padded
    slots = torch.tensor(s["slots"] + [-1] * padded, device=device)
    key, value = (torch.randn(total, kvh, hd, generator=g).to(device, dtype) for _ in range(2))
    store_kv_triton(key, value, kv, slots)
    real = slots[:s["starts"][-1]]
    flat_k = kv[0].view(-1, kvh, hd)
    stored = bool(torch.equal(flat_k[real], key[:real.numel()]))
    query = torch.randn(total, cfg["heads"], hd, generator=g).to(device, dtype)
    table = s["table"].to(device)
    seq_lens = torch.tensor(s["seq_lens"], dtype=torch.int32, device=device)
    qsl = torch.tensor(s["starts"], dtype=torch.int32, device=device)
    scale = hd ** -0.5
    want = paged_attention_ref(query[:real.numel()], kv, table, seq_lens, qsl, scale).float()
    result = {"device": device, "cache_elements": kv.numel(), "over_2_31": kv.numel() > 2**31,
              "max_offset_elements": int(used.max()) * per_block // 2, "stored": stored,
              "splits": {}}
    for splits in (1, 4, 32):
        out = paged_attention_triton(query, kv, table, seq_lens, qsl, scale,
                                     max_seq_len=max(s["seq_lens"]), max_query_len=9,
                                     num_splits=splits)
        diff = float((out[:real.numel()].float() - want).abs().max())
        zero = bool(torch.equal(out[real.numel():], torch.zeros_like(out[real.numel():])))
        result["splits"][splits] = {"max_abs_diff": diff, "padded_zero": zero,
                                    "ok": diff <= cfg["bound"] and zero}
    result["bound"] = cfg["bound"]
    result["ok"] = stored and all(r["ok"] for r in result["splits"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small cache (CPU: always)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
    result = run(args.tiny or not torch.cuda.is_available())
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
