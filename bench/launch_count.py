"""Kernel launches per decoder layer in one decode step on the GPU path (issue 32: ~12).

    python bench/launch_count.py [--models llama,gemma3] [--batch N] [--padded N] [--layers N]
                                 [--unfused] [--json]

Builds a tiny Llama or Gemma 3 (hidden 64, 4 query / 2 KV heads of 16, random weights, fp32;
Gemma's first layer sliding) over a paged cache of noise, and runs one decode step of `--batch` sequences plus `--padded` padding rows
(slot -1, as a CUDA graph's padded batch) on the Triton backend with the fused layer ops,
counting launches with `kserve_paged_kernels.launches`: one steady-state layer (a residual coming in), and
the whole forward. On CUDA the kernels are compiled; without it they run in Triton's
interpreter (this script sets TRITON_INTERPRET=1 and the triton backend before Triton is
imported), which launches the same kernels. The same step on the eager path (the `cpu`
backend) checks that the fused path computes the same hidden states and cache. The shape does
not change the count: every op is one launch whatever its size. `--unfused` counts the same
step with the fused ops off (the layers' eager PyTorch code, as the GPU path ran before them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
if "--unfused" in sys.argv:  # CPU: no native ops either, so the eager ops are what is counted
    os.environ["KSERVE_PAGED_NATIVE"] = "0"

from kserve_paged_kernels.launches import LaunchCount, counting  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
MODELS = ("llama", "gemma3")
BLOCK_SIZE = 4


def _model(name: str, layers: int) -> torch.nn.Module:
    from transformers import Gemma3TextConfig, LlamaConfig

    from kserve_paged_engine.model_executor.models import GemmaForCausalLM, LlamaForCausalLM

    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **TINY))
    types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
    return GemmaForCausalLM(Gemma3TextConfig(
        num_hidden_layers=layers, sliding_window=8, layer_types=types, query_pre_attn_scalar=16,
        **TINY))


def _step(name: str, batch: int, padded: int, layers: int, device: str) -> dict[str, Any]:
    """A tiny model and one decode step's inputs: contexts of different lengths in shuffled
    blocks, new tokens' slots at each context's end, padded rows with slot -1 past
    query_start_loc[-1]."""
    from kserve_paged_engine.model_executor.attention import AttentionMetadata

    torch.manual_seed(0)
    model = _model(name, layers).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(device)
    seq_lens = [5 + 7 * i for i in range(batch)]
    per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = batch * per_seq + 2
    blocks = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq).int()
    slots = [int(blocks[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for i, n in enumerate(seq_lens)]
    kv = [torch.randn(2, num_blocks, BLOCK_SIZE, TINY["num_key_value_heads"], TINY["head_dim"],
                      device=device) for _ in range(layers)]
    to = dict(device=device)
    meta = AttentionMetadata.build(
        blocks.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to),
        torch.arange(batch + 1, dtype=torch.int32, **to),
        torch.tensor(slots + [-1] * padded, **to), max_seq_len=max(seq_lens), max_query_len=1)
    ids = torch.randint(0, TINY["vocab_size"], (batch + padded,), **to)
    positions = torch.tensor([n - 1 for n in seq_lens] + [0] * padded, **to)
    return dict(model=model, meta=meta, ids=ids, positions=positions, kv=kv)


def _with_backend(meta: Any, backend: str) -> Any:
    from dataclasses import replace

    return replace(meta, backend=backend, plan=None)


def _fused_ops_off() -> None:
    from kserve_paged_kernels import fused_ops

    fused_ops.add_rms_norm = lambda *args, **kwargs: None
    fused_ops.act_mul = lambda *args, **kwargs: None
    fused_ops.rope_store_ = lambda *args, **kwargs: False


def count_decode_step(name: str = "llama", batch: int = 3, padded: int = 1, layers: int = 2,
                      unfused: bool = False) -> dict[str, Any]:
    """Launch counts of one decode step of model `name` (one layer, and the whole forward) on
    the Triton path, and its difference from the eager path's hidden states and caches."""
    if unfused:
        _fused_ops_off()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from kserve_paged_kernels.testing import faithful_interpreter

        faithful_interpreter()
    s = _step(name, batch, padded, layers, device)
    model, ids, positions = s["model"], s["ids"], s["positions"]
    triton_meta = _with_backend(s["meta"], "triton")
    eager_kv = [c.clone() for c in s["kv"]]
    fused_kv = [c.clone() for c in s["kv"]]
    layer = model.model.layers[layers - 1]
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        # A steady-state layer: the running residual comes in with the last block's output.
        args = (x, torch.randn_like(x))
        cache = s["kv"][0].clone()
        with counting() as one_layer:
            layer(positions, *args, cache, triton_meta)
        with counting() as whole:
            hidden = model(ids, positions, fused_kv, triton_meta)
        os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "cpu"  # the eager path, fused ops off
        try:
            want = model(ids, positions, eager_kv, _with_backend(s["meta"], "cpu"))
        finally:
            os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    return {
        "model_name": name, "device": device, "batch": batch, "padded": padded,
        "layers": layers, "fused": not unfused,
        "layer": _as_dict(one_layer), "model": _as_dict(whole),
        "max_abs_diff": float((hidden[:batch] - want[:batch]).abs().max()),
        "cache_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(fused_kv, eager_kv)),
    }


def count_steps(names: list[str], batch: int = 3, padded: int = 1, layers: int = 2,
                unfused: bool = False) -> dict[str, Any]:
    """`count_decode_step` for each model of `names`: what --json prints."""
    return {n: count_decode_step(n, batch, padded, layers, unfused) for n in names}


def _as_dict(count: LaunchCount) -> dict[str, Any]:
    return {"total": count.total, "syncs": count.syncs, "triton": dict(count.triton),
            "aten": dict(count.aten), "table": count.table()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama", help=f"comma-separated, of {MODELS}")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--padded", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--unfused", action="store_true", help="the fused ops off")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if any(n not in MODELS for n in names):
        parser.error(f"--models: choose from {MODELS}")
    results = count_steps(names, args.batch, args.padded, args.layers, args.unfused)
    if args.json:
        print(json.dumps(results))
        return 0
    for name, r in results.items():
        print(f"{name}: one decoder layer, decode step of {args.batch} rows + {args.padded} "
              f"padded ({r['device']}, fused ops {'off' if args.unfused else 'on'}):\n"
              f"{r['layer']['table']}\n")
        print(f"{name}: whole forward, {args.layers} layers: {r['model']['total']} launches; "
              f"fused vs eager: hidden max abs diff {r['max_abs_diff']:.2e}, caches "
              f"{r['cache_max_abs_diff']:.2e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
