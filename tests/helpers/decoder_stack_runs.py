"""The step sequences the native decoder stack's tests replay, and the run that compares the
one-call stack with the per-layer modules: tests/kernels/test_decoder_stack.py,
test_decoder_stack_bf16.py and test_kv_quant_native.py drive the stack alike, so a case one of
them adds is a case for all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata
from tests.helpers.tiny_models import VOCAB

Batch = list[tuple[int, list[int]]]  # (sequence, its new tokens) per row of a step
# A run's step logits and the KV caches it wrote.
Run = tuple[list[torch.Tensor], list[Any]]


def mixed_steps(seed: int) -> list[Batch]:
    """Three prompts' prefills, one cut into two chunks, then decodes alongside."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n + 3,), generator=g).tolist() for n in (5, 17, 33)]
    half = 16
    return [
        [(0, seqs[0][:5]), (1, seqs[1][:17]), (2, seqs[2][:half])],
        [(0, seqs[0][5:6]), (1, seqs[1][17:18]), (2, seqs[2][half:33])],
        [(1, seqs[1][18:19]), (0, seqs[0][6:7]), (2, seqs[2][33:34])],
        [(2, seqs[2][34:35])],
    ]


def long_steps(seed: int) -> list[Batch]:
    """A prefill of 37 rows, then a chunk of 41 rows starting at the odd position 37 (two
    transposed-key runs, one starting odd), with decodes alongside."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (80, 9)]
    return [
        [(0, seqs[0][:37]), (1, seqs[1][:8])],
        [(1, seqs[1][8:9]), (0, seqs[0][37:78])],
        [(0, seqs[0][78:79]), (1, seqs[1][8:9])],
    ]


def one_step_inputs(model: Any, positions: list[int], slots: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """One sequence's step by hand (ids, positions, zeroed caches of 8 blocks of 4, metadata),
    to feed the model positions and slots out of range."""
    n = len(positions)
    kv = [torch.zeros(2, 8, 4, model.num_kv_heads, model.head_dim)
          for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.arange(8, dtype=torch.int32).view(1, 8),
        seq_lens=torch.tensor([max(positions) + 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_seq_len=max(positions) + 1, max_query_len=n)
    return torch.tensor([1] * n), torch.tensor(positions), kv, meta


def stack_and_modules(model: Any, run: Callable[[Any], Run]) -> tuple[Run, Run]:
    """`run(model)` on the one-call native stack, then on the per-layer modules; asserts the
    stack ran once a step in the first and never in the second (so the comparison means
    something)."""
    results = {}
    for use in (True, False):
        model.use_native_stack = use
        calls: list[int] = []
        real_run = model.native_stack.run
        model.native_stack.run = lambda *a, _real=real_run, _calls=calls, **k: (
            _calls.append(1), _real(*a, **k))[1]
        try:
            results[use] = run(model)
        finally:
            del model.native_stack.run
        assert len(calls) == (len(results[use][0]) if use else 0)
    return results[True], results[False]
