"""Multi-head latent attention: the latent cache's tokens per GiB, and decode absorbed vs expanded.

1. Tokens per GiB of KV cache, as the engine sizes it (`kv_sizing.size_kv_cache` over the
   model's own facts, `model_facts.describe`: no weights), for DeepSeek-V3's config
   (tests/data/models/deepseek-v3: 61 layers, one latent of 512 + 64 values per token and
   layer) against a model of the same size with ordinary GQA KV (the same 61 layers and
   hidden size as a Llama with 8 KV heads of 128) and against MLA expanded to per-head K/V
   (128 heads x (192 key + 128 value)), in bf16 and with an int8 cache.
2. Decode step time on CPU of a small MLA model (random weights, float32) absorbed vs expanded:
   `--batch` sequences of `--context` tokens each, one new token per sequence per step; wall
   and CPU time per step (CPU time holds up better on a shared machine).

    python bench/bench_mla.py [--batch 8] [--context 512] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig

from kserve_paged_engine.core.kv_sizing import size_kv_cache
from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.model_facts import describe
from kserve_paged_engine.model_executor.models.deepseek import DeepseekV3ForCausalLM
from kserve_paged_kernels import kv_formats

GiB = 1 << 30
DEEPSEEK_V3 = Path(__file__).resolve().parents[1] / "tests" / "data" / "models" / "deepseek-v3"


def tokens_per_gib(config: object, kv_cache_dtype: str = "auto", block_size: int = 64) -> int:
    """Tokens a 1 GiB KV cache holds under the engine's sizing rule (bf16 elements)."""
    facts = describe(config)
    size = size_kv_cache(facts, dtype_bytes=kv_formats.element_bytes(kv_cache_dtype, 2),
                         scale_bytes=kv_formats.scale_bytes(kv_cache_dtype),
                         block_size=block_size, hybrid=True, tp=1, device_type="cuda",
                         num_kv_blocks=None, kv_cache_memory=GiB, free_bytes=lambda: GiB)
    return size.num_blocks * block_size


def capacity() -> None:
    ds = AutoConfig.from_pretrained(DEEPSEEK_V3, local_files_only=True)
    gqa = LlamaConfig(hidden_size=ds.hidden_size, intermediate_size=ds.intermediate_size,
                      num_hidden_layers=ds.num_hidden_layers, num_attention_heads=56,
                      num_key_value_heads=8, head_dim=128, vocab_size=ds.vocab_size,
                      max_position_embeddings=4096)
    per_head = 2 * ds.num_hidden_layers * ds.num_attention_heads * (  # K + V, bf16 bytes
        ds.qk_nope_head_dim + ds.qk_rope_head_dim + ds.v_head_dim)
    print("KV cache capacity, tokens per GiB (engine sizing, block 64, bf16)")
    for label, config in (("DeepSeek-V3 MLA latent (576 values/layer)", ds),
                          ("same-size GQA, 8 KV heads x 128 (2,048 values/layer)", gqa)):
        print(f"  {label:<56} {tokens_per_gib(config):>8,}  "
              f"int8: {tokens_per_gib(config, 'int8'):>8,}")
    print(f"  {'MLA expanded to per-head K/V (40,960 values/layer)':<56} "
          f"{GiB // per_head:>8,}  (arithmetic)")


def _tiny_mla() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, first_k_dense_replace=4, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.rotary_emb.rebuild()
    model.pack_weights()
    return model


def decode_times(batch: int, context: int, steps: int, block: int = 16) -> None:
    model = _tiny_mla()
    blocks_per_seq = -(-(context + steps) // block)
    num_blocks = batch * blocks_per_seq
    caches = [torch.zeros(2, num_blocks, block, 1, model.head_dim)
              for _ in range(model.num_layers)]
    tables = torch.arange(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)

    def step(pos: int, ids: torch.Tensor, q_len: int) -> None:
        positions = torch.arange(pos, pos + q_len).repeat(batch)
        slots = (tables.long()[:, :, None] * block + torch.arange(block)).view(batch, -1)
        slot_mapping = slots[:, pos:pos + q_len].reshape(-1)
        starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
        meta = AttentionMetadata.build(tables, torch.full((batch,), pos + q_len,
                                                          dtype=torch.int32), starts,
                                       slot_mapping)
        with torch.inference_mode():
            model(ids, positions, caches, meta)

    g = torch.Generator().manual_seed(1)
    model.set_mla_mode("expanded")
    step(0, torch.randint(0, 256, (batch * context,), generator=g), context)  # prefill
    print(f"decode step, {batch} sequences x {context} context, 4 layers, 16 heads, "
          f"kv_lora_rank 128 (float32, CPU, torch reference)")
    for mode in ("absorbed", "expanded"):
        model.set_mla_mode(mode)
        wall, cpu = [], []
        for i in range(steps):
            ids = torch.randint(0, 256, (batch,), generator=g)
            t0, c0 = time.perf_counter(), time.process_time()
            step(context + i, ids, 1)  # both modes decode the same positions
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(f"  {mode:<9} wall median {statistics.median(wall) * 1e3:8.2f} ms, min "
              f"{min(wall) * 1e3:8.2f} ms; CPU time median {statistics.median(cpu) * 1e3:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: CPU time is the step's own work)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    capacity()
    decode_times(args.batch, args.context, args.steps)


if __name__ == "__main__":
    main()
