"""The bf16 decode-span kernel's cases: the bf16 rows (tests/kernels/test_paged_bf16.py) and the
quantized cache's spans (test_kv_quant_native.py) run the same shapes, so a shape added for one
kernel is checked on both.
"""

from __future__ import annotations

SPAN_CASES = [  # (seq_lens, heads, kv_heads, head_dim, block_size): decode rows, head dims
    # 64, 128 and 256 (spans of 256 keys, V_HEADS = 4 query heads a pass over the values)
    ([700, 257, 256, 15], 6, 2, 128, 16),  # group 3 at 128 (V in slices); spans and their tails
    ([513, 16, 17], 5, 1, 64, 8),          # passes of 4 heads and 1; blocks shorter than 16 keys
    ([300, 33], 7, 7, 64, 1),              # one query head per KV head, blocks of one key
    ([600, 2], 14, 2, 128, 32),            # passes of 4 heads and 3 at 128
    ([290, 40], 8, 2, 256, 16),            # Gemma-3's head dim, group 4
]


def span_case_id(case: tuple) -> str:
    """A case's test id: heads x KV heads, head dim, block size."""
    return f"h{case[1]}x{case[2]}-d{case[3]}-bs{case[4]}"
