"""kserve_paged_engine.worker.kv_prefault: the KV cache's leading pages made resident in the
background without writing to them, the foreground fallback, and the offline LLM waiting."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kserve_paged_engine import LLM
from kserve_paged_engine.worker import kv_prefault
from kserve_paged_engine.worker.cpu_memory import hugepage_zeros
from kserve_paged_engine.worker.kv_prefault import KVPrefault
from tests.helpers.tiny_models import copy_default_tokenizer, save_random

linux = pytest.mark.skipif(sys.platform != "linux", reason="lazily zeroed mappings: Linux only")
SHAPE = (2, 512, 16, 3, 64)  # 6 MiB a half: blocks past the first 2 MiB page stay lazy
BLOCK = 16 * 3 * 64  # floats a block holds in one half


def resident(t: torch.Tensor, first_float: int, floats: int) -> list[bool]:
    """Per page of t's floats [first_float, first_float + floats): whether it is in memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = t.data_ptr() + 4 * first_float
    aligned = start & ~(mmap.PAGESIZE - 1)
    length = start + 4 * floats - aligned
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(aligned, length, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


@linux
def test_the_leading_blocks_become_resident_and_keep_what_was_written() -> None:
    caches = [hugepage_zeros(SHAPE, torch.float32) for _ in range(2)]
    # A block the engine filled before the prefault reached it (values at page starts, where
    # a touching prefault would write its zero).
    caches[0][0].view(-1)[0] = 7.0
    caches[1][1].view(-1)[100 * BLOCK] = -3.0
    assert not any(resident(caches[1][0], 0, 128 * BLOCK))  # fresh: nothing resident yet
    prefault = KVPrefault(caches, 128)
    prefault.wait()
    assert prefault.done and prefault.seconds is not None
    for cache in caches:
        for half in cache:
            assert all(resident(half, 0, 128 * BLOCK))
            assert not any(resident(half, 511 * BLOCK, BLOCK))  # past the budget: still lazy
    assert caches[0][0].view(-1)[0] == 7.0 and caches[1][1].view(-1)[100 * BLOCK] == -3.0
    assert sum(int(c.count_nonzero()) for c in caches) == 2


@linux
def test_without_the_kernel_call_the_pages_are_touched_in_the_foreground(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_prefault, "_madvise", lambda: None)
    caches = [hugepage_zeros(SHAPE, torch.float32)]
    prefault = KVPrefault(caches, 64)
    assert prefault.done and prefault.seconds is not None  # done before the constructor returned
    assert all(resident(caches[0][1], 0, 64 * BLOCK))
    assert caches[0].count_nonzero() == 0


def test_no_blocks_means_no_thread() -> None:
    prefault = KVPrefault([torch.zeros(SHAPE)], 0)
    assert prefault.done and prefault.seconds == 0.0


def test_the_offline_llm_waits_for_the_prefault(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    save_random(cfg, tmp_path)
    copy_default_tokenizer(tmp_path)
    waited: list[KVPrefault] = []
    monkeypatch.setattr(KVPrefault, "wait", lambda self: waited.append(self))
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, dtype="float32")
    assert waited == [llm.engine.runner.prefault]
