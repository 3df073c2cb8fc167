"""Random paged-attention inputs shared by the tests, the CPU benchmark and bench/gpu_check.py.

Blocks are handed out from a shuffled pool so sequences never own contiguous memory, unused
block-table entries are 0 and the whole cache starts as noise, so reading past `seq_lens` or
from the wrong block shows up as a wrong answer rather than as a lucky zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LORA_CASES", "PagedCase", "faithful_interpreter", "make_case", "make_lora_case",
           "tolerance"]


@dataclass
class PagedCase:
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_seq_len: int
    max_query_len: int

    def args(self) -> tuple:
        return (self.query, self.kv_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_case(seq_lens: list[int], q_lens: list[int], *, num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", seed: int = 0, spare_blocks: int = 3,
              wide_table: bool = False, identity_blocks: bool = False) -> PagedCase:
    """Build one varlen batch. `wide_table` hands out a non-contiguous block-table view;
    `identity_blocks` lays every sequence out contiguously (for the paged-overhead benchmark)."""
    assert len(seq_lens) == len(q_lens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    max_blocks = max(need, default=1) + 1
    if identity_blocks:
        pool = torch.arange(num_blocks)
    else:
        pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max_blocks * (2 if wide_table else 1), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        cols = torch.arange(n) * (2 if wide_table else 1)
        table[i, cols] = pool[pos:pos + n].int()
        pos += n
    if wide_table:  # even columns hold the blocks: a strided, non-contiguous view
        table_view = table.to(device)[:, ::2]
    else:
        table_view = table.to(device)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    total = sum(q_lens)
    query = torch.randn(total, num_heads, head_dim, generator=gen)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return PagedCase(
        query=query.to(device=device, dtype=dtype),
        kv_cache=kv_cache.to(device=device, dtype=dtype),
        block_tables=table_view,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
        max_seq_len=max(seq_lens, default=0),
        max_query_len=max(q_lens, default=0),
    )


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) against the fp32 reference. Inputs are ~N(0, 1) so outputs are O(1):
    fp32 differs only by summation order; fp16/bf16 by rounding of inputs to P and the output."""
    return {
        torch.float32: (2e-5, 1e-4),
        torch.float16: (4e-3, 4e-3),
        torch.bfloat16: (3e-2, 2e-2),
    }[dtype]


# LoRA SGMV cases: (name, segment lengths, slot per segment, rank per slot, in, out).
LORA_CASES = [
    ("decode-bgmv", [1, 1, 1, 1], [0, 2, 1, 0], [8, 16, 4], 64, 96),
    ("prefill-sgmv", [17, 40, 3], [1, 0, 2], [8, 8, 16], 96, 64),
    ("rank-32-wide", [20], [0], [32], 130, 200),
    ("rank-12-padded-to-16", [5, 9], [0, 1], [12, 4], 48, 40),  # a tile reads past the rank
]


def make_lora_case(seg_lens: list[int], slots: list[int], ranks: list[int], in_f: int,
                   out_f: int, dtype: torch.dtype, total_rows: int, device: str = "cpu",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword arguments of `kserve_paged_kernels.reference.lora_sgmv_ref` (and the kernels that compute
    the same): slots of lower rank zero-padded, as the engine stacks them; the segments' rows
    distinct and in any order, the other rows of `out` noise the kernels must leave alone."""
    g = torch.Generator().manual_seed(seed)
    num_slots, max_rank = len(ranks), max(ranks)
    a = torch.zeros(num_slots, max_rank, in_f)
    b = torch.zeros(num_slots, out_f, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g) * 0.1
        b[s, :, :r] = torch.randn(out_f, r, generator=g) * 0.1
    x = torch.randn(total_rows, in_f, generator=g)
    out = torch.randn(total_rows, out_f, generator=g)
    rows = torch.randperm(total_rows, generator=g)[:sum(seg_lens)]
    starts = torch.tensor([0] + seg_lens[:-1]).cumsum(0)
    scales = torch.rand(num_slots, generator=g) + 0.5
    return dict(x=x.to(device, dtype), out=out.to(device, dtype),
                a_stack=a.to(device, dtype), b_stack=b.to(device, dtype),
                scales=scales.to(device), rows=rows.to(device), seg_start=starts.to(device),
                seg_len=torch.tensor(seg_lens, device=device),
                seg_slot=torch.tensor(slots, device=device))


def faithful_interpreter() -> None:
    """Make Triton's CPU interpreter compute what a GPU computes, where it does not (call once,
    in a process that interprets; imports Triton):
    - float32 -> bfloat16 casts round to nearest even (the interpreter, 3.6 to 3.9, truncates,
      which puts a one-step error in every bf16 result and hides where a kernel rounds);
    - a one-element block used as a Python int (a loop bound) works with numpy 2 (3.6's
      interpreter calls `int()` on a 1-d array, which numpy 2 refuses; later versions squeeze).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kp_faithful", False):
        return
    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202 - the interpreter's signature
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
        return interpreter.TensorHandle(out, dst_type.scalar)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):  # noqa: ANN001, ANN202
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda t: int(np.asarray(t.handle.data).squeeze()))

    builder.cast_impl = cast_impl
    interpreter._patch_lang_tensor = patch_lang_tensor
    builder._kp_faithful = True
