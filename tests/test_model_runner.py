"""The runner's flat step tensors for a mixed step, and its reuse of buffers across steps."""

from types import SimpleNamespace

import torch

from kserve_paged_engine.worker.model_runner import ModelRunner
from tests.helpers.core import apply_step, fake_step, make_request, make_scheduler

BS = 4


def make_runner(sched):
    model = SimpleNamespace(num_kv_heads=1, head_dim=2, num_layers=1)
    return ModelRunner(model, sched.kv, sched.kv.num_blocks, BS, torch.float32,
                       torch.device("cpu"), max_num_batched_tokens=sched.config.max_num_batched_tokens,
                       max_num_seqs=sched.config.max_num_seqs, max_model_len=sched.max_model_len)


def test_mixed_step_tensors_match_each_requests_blocks_and_positions():
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=12)
    a = make_request("a", list(range(10, 16)), max_tokens=5)   # 6 tokens
    b = make_request("b", list(range(40, 50)), max_tokens=5)   # 10 tokens: chunked
    sched.add_request(a)
    sched.add_request(b)
    runner = make_runner(sched)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6, "b": 6}
    first = runner.prepare(out)
    ptr = first.input_ids.data_ptr()
    apply_step(sched, out, fake_step(sched, out))
    out = sched.schedule()  # a decodes one token, b finishes its prompt (4 tokens)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    step = runner.prepare(out)
    assert step.input_ids.data_ptr() == ptr  # the same buffer, refilled
    assert step.input_ids.tolist() == [a.output_token_ids[0], 46, 47, 48, 49]
    assert step.positions.tolist() == [6, 6, 7, 8, 9]
    meta = step.meta
    assert meta.query_start_loc.tolist() == [0, 1, 5]
    assert meta.seq_lens.tolist() == [7, 10]
    assert meta.max_seq_len == 10 and meta.max_query_len == 4
    ids_a, ids_b = sched.kv.block_ids("a"), sched.kv.block_ids("b")
    assert meta.block_tables.tolist() == [ids_a + [0] * (3 - len(ids_a)), ids_b]
    expected = [ids_a[6 // BS] * BS + 6 % BS] + [ids_b[p // BS] * BS + p % BS for p in range(6, 10)]
    assert meta.slot_mapping.tolist() == expected
    assert step.logits_indices.tolist() == [0, 4]
    assert [r.request_id for r in step.sampling] == ["a", "b"]
    # Each token's attention row, built by the runner: keys seen (its position + 1) and its
    # sequence, the same as the metadata's own derivation from seq_lens / query_start_loc.
    assert meta.backend == "cpu"
    assert meta.row_lens.tolist() == [7, 7, 8, 9, 10] and meta.row_lens.dtype == torch.int32
    assert meta.row_seq_idx.tolist() == [0, 1, 1, 1, 1]
    derived = type(meta)(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, meta.max_seq_len, meta.max_query_len)
    assert [t.tolist() for t in derived.rows(5)] == [[7, 7, 8, 9, 10], [0, 1, 1, 1, 1]]


def test_rows_after_a_prefix_hit_start_past_the_cached_tokens():
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=64)
    shared = list(range(100, 112))  # 3 full blocks
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=3))
    runner = make_runner(sched)
    out = sched.schedule()
    runner.prepare(out)
    apply_step(sched, out, fake_step(sched, out))
    sched.add_request(make_request("b", shared + [7, 8, 9], max_tokens=3))
    out = sched.schedule()  # a decodes; b hits the 3 shared blocks and computes 3 tokens
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    meta = runner.prepare(out).meta
    assert meta.row_lens.tolist() == [15, 13, 14, 15]
    assert meta.row_seq_idx.tolist() == [0, 1, 1, 1]
