"""CUDA graphs for decode (issue 32, item 3), the parts that are plain code, on CPU: the
capture sizes, the padded size of a step, the persistent buffers' filling, padded rows'
exactly-zero attention (CPU backend here, the Triton kernel interpreted in a child), and the
engine's decode through `RecordReplay` (a stand-in that records the forward and replays it over
the same buffers) giving the eager engine's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kserve_paged_kernels as kernels
from kserve_paged_engine.worker.cuda_graphs import (
    GraphBuffers,
    RecordReplay,
    capture_sizes,
    padded_size,
)
from kserve_paged_kernels.reference import paged_attention_ref
from tests.kernels.interpreted import run_calls


def test_capture_sizes_follow_vllms_list_capped_by_max_num_seqs() -> None:
    full = capture_sizes(1024)
    assert full[:5] == [1, 2, 4, 8, 16] and 256 in full and 264 not in full
    assert full[full.index(256) + 1] == 272 and full[-1] == 512
    assert all(b - a == 8 for a, b in zip(full[3:], full[4:]) if b <= 256)
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35
    assert capture_sizes(10) == [1, 2, 4, 8]
    assert capture_sizes(1) == [1]


def test_a_step_takes_the_smallest_size_that_holds_it() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert padded_size(65, sizes) is None


def _decode_meta(seq_lens: list[int], bs: int, width: int) -> kernels.AttentionMetadata:
    n = len(seq_lens)
    tables = torch.arange(n * width, dtype=torch.int32).view(n, width)
    slots = torch.tensor([int(tables[i, (s - 1) // bs]) * bs + (s - 1) % bs
                          for i, s in enumerate(seq_lens)])
    return kernels.AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        max_seq_len=max(seq_lens), max_query_len=1)


def test_buffers_hold_the_step_then_padding() -> None:
    buf = GraphBuffers(8, max_blocks_per_seq=6, device=torch.device("cpu"))
    buf.block_tables.fill_(77)
    meta = _decode_meta([5, 9, 3], bs=4, width=3)
    buf.fill(torch.tensor([11, 12, 13]), torch.tensor([4, 8, 2]), meta, size=4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [4, 8, 2, 0]
    assert buf.slot_mapping[:4].tolist() == meta.slot_mapping.tolist() + [-1]
    assert buf.seq_lens[:4].tolist() == [5, 9, 3, 0]
    assert buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 3]  # the padded row: no tokens
    assert buf.block_tables.stride(0) == 6  # fixed row stride, whatever the step's width
    assert torch.equal(buf.block_tables[:3, :3], meta.block_tables)
    graph_meta = buf.metadata(4, max_seq_len=24, backend="cpu")
    assert graph_meta.block_tables.shape == (4, 6) and graph_meta.max_query_len == 1
    assert graph_meta.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()


def _padded_attention_inputs(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    bs, heads, kv_heads, hd = 4, 4, 2, 16
    cache = torch.randn(2, 12, bs, kv_heads, hd, generator=g)
    buf = GraphBuffers(8, max_blocks_per_seq=4, device=torch.device("cpu"))
    meta = _decode_meta([5, 9, 3], bs=bs, width=3)
    buf.fill(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), meta, size=8)
    query = torch.randn(8, heads, hd, generator=g)
    query[3:] *= 100  # padded rows' queries are garbage
    return query, cache, buf.metadata(8, max_seq_len=16, backend="cpu"), meta


def test_padded_rows_attend_to_exactly_zero_on_the_cpu_backend() -> None:
    query, cache, meta, real = _padded_attention_inputs()
    out = kernels.attend(query, cache, meta, 0.25)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    want = paged_attention_ref(query[:3], cache, real.block_tables, real.seq_lens,
                               real.query_start_loc, 0.25)
    torch.testing.assert_close(out[:3], want, atol=1e-5, rtol=1e-5)


def test_padded_rows_attend_to_exactly_zero_in_the_triton_kernel(tmp_path: Path) -> None:
    """With splits, a padded row's partials are never written: they must not reach the output
    even when the scratch memory holds NaN (the child's float32 `torch.empty` is poisoned)."""
    query, cache, meta, real = _padded_attention_inputs(1)
    calls = [("tests.kernels.interpreted", "poison_empty", (), {})]
    calls += [("kserve_paged_kernels.triton_backend", "paged_attention_triton",
              (query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25),
              {"max_seq_len": 16, "max_query_len": 1, "num_splits": splits})
             for splits in (1, 4)]
    want = paged_attention_ref(query[:3], cache, real.block_tables, real.seq_lens,
                               real.query_start_loc, 0.25)
    for out, _ in run_calls(calls, tmp_path)[1:]:
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
        torch.testing.assert_close(out[:3], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_num_seqs", [4, 16])
def test_replayed_decode_gives_the_eager_tokens(tmp_path: Path, max_num_seqs: int) -> None:
    """Three requests of different lengths (a padded size-4 step, then size 2 and 1 as they
    finish): the stand-in's replays give what the eager engine gives, every decode step is a
    replay, and prefill is not."""
    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    save_tokenizer(path)
    prompts = [[3 + i for i in range(n)] for n in (5, 14, 9)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 3, 8)]
    kw = dict(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=64,
              max_num_seqs=max_num_seqs)
    eager = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params,
                                                                 use_tqdm=False)]
    llm = LLM(**kw)
    stand_in = RecordReplay()
    assert llm.engine.runner.capture_graphs(max_num_seqs, stand_in) is None
    graphs = llm.engine.runner.graphs
    assert len(stand_in.captured) == len(capture_sizes(max_num_seqs))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager
    # Decode steps: 3 rows (size 4) twice, then 2 rows, then 1 row twice (6 - 3 - 1 = 2).
    assert graphs.used == {4: 2, 2: 3, 1: 2} and stand_in.replays == 7


def test_moe_decode_is_captured_only_where_its_routing_reads_nothing_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mixtral on the grouped torch path (here, CPU: each expert's count read on the host) is
    declined before any capture; with the fused kernel's device-side routing it is captured
    (its forward stood in for by the reference, which takes the same arguments)."""
    from kserve_paged_engine import LLM
    from kserve_paged_engine.model_executor.models import moe
    from kserve_paged_kernels.reference import fused_moe_ref
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    path, _ = save_checkpoint(CONFIGS["mixtral_4x_top2"], tmp_path)
    save_tokenizer(path)
    kw = dict(model=str(path), block_size=4, num_kv_blocks=32, max_model_len=32, max_num_seqs=4)
    stand_in = RecordReplay()
    why = LLM(**kw).engine.runner.capture_graphs(4, stand_in)
    assert why is not None and "MoE" in why and stand_in.captured == []
    monkeypatch.setattr(moe, "_fused_moe_kernel", lambda device: fused_moe_ref)
    llm = LLM(**kw)
    assert llm.engine.runner.capture_graphs(4, stand_in) is None
    assert len(stand_in.captured) == len(capture_sizes(4))
