"""The second KV tier end to end (engine/kserve_paged_engine/core/kv_tier/disk.py): a prompt whose prefix blocks were
evicted from the pool to the disk tier comes back, is restored instead of recomputed, and
continues greedily token for token as computed from scratch; cache salts and LoRA adapters
isolate; a corrupt tier file is a miss, never a wrong answer.

What holds on every machine type (AVX2-only, AVX-512 without bf16, AVX512-BF16, AMX): the
restored bytes are the evicted bytes, so a tier hit computes exactly what a pool hit computes;
in float32 both equal a run without prefix caching. In bfloat16 the comparison is with the
same engine's pool hit (a prefill cut at another place may round differently on another ISA).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kserve_paged_engine.lora import LoRARequest
from tests.helpers.kv_tier_engine import (
    BS,
    GREEDY,
    PROMPT,
    engine,
    flood,
    hits,
    run,
    tier_dirs,
)
from tests.helpers.lora import make_adapter


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tier_dirs(tmp_path_factory)


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpu-native", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tier_hit_continues_as_computed_from_scratch(dirs, tmp_path, monkeypatch, dtype,
                                                       native):
    monkeypatch.setenv("KSERVE_PAGED_NATIVE", native)
    llm = engine(dirs, dtype, tmp_path)
    first = run(llm, PROMPT)
    again = run(llm, PROMPT)  # a pool hit: the bytes still in place
    assert again == first
    flood(llm)
    assert llm.engine.kv.pool.lookup(llm.engine.kv.hasher(None, PROMPT[:BS])) is None
    before = hits(llm)
    restored = run(llm, PROMPT)
    assert hits(llm) - before == 10  # every full block before the last token, from disk
    assert restored == first
    stats = llm.stats()  # what the server's metrics read (kserve_paged/metrics.py)
    assert stats["kv_tier_block_hits"] >= 10 and stats["kv_tier_read_bytes"] > 0
    assert stats["kv_tier_write_bytes"] > 0 and 0 < stats["kv_tier_usage"] <= 1
    if dtype == "float32":
        scratch = engine(dirs, dtype, None, enable_prefix_caching=False)
        assert run(scratch, PROMPT) == first
    llm.engine.close()


def test_a_tier_hit_under_an_int8_kv_cache_restores_codes_and_scales(dirs, tmp_path):
    """A quantized cache's blocks travel with their per-(K/V, block, head) scales: a block
    restored from the disk reads as it was written, so the answer is the computed one."""
    llm = engine(dirs, "float32", tmp_path, kv_cache_dtype="int8")
    first = run(llm, PROMPT)
    flood(llm)
    before = hits(llm)
    assert run(llm, PROMPT) == first
    assert hits(llm) - before == 10
    scratch = engine(dirs, "float32", None, kv_cache_dtype="int8", enable_prefix_caching=False)
    assert run(scratch, PROMPT) == first
    llm.engine.close()


def test_a_tier_hit_on_the_triton_backend_continues_as_computed(gpu_path) -> None:  # noqa: ANN001
    """The GPU path (the Triton attention backend, interpreted without CUDA): the tier's
    copies go through the same slot tensors, so a restored prompt continues as computed, and
    as the CPU backend computes it."""
    from tests.helpers.kv_tier_child import serve

    triton = gpu_path.call("tests.helpers.kv_tier_child", "serve")
    cpu = serve()
    assert (triton["backend"], cpu["backend"]) == ("triton", "cpu")
    assert triton["hits"] == cpu["hits"] > 0  # blocks the floods evicted, read from the disk
    assert triton["restored"] == triton["first"] == cpu["first"]


def test_cache_salts_isolate_in_the_tier(dirs, tmp_path):
    llm = engine(dirs, "float32", tmp_path)
    salted = run(llm, PROMPT, salt="tenant-a")
    flood(llm)
    before = hits(llm)
    assert run(llm, PROMPT, salt="tenant-b") == salted  # same tokens, computed again
    assert hits(llm) == before
    flood(llm)
    before = hits(llm)
    assert run(llm, PROMPT, salt="tenant-a") == salted
    assert hits(llm) - before == 10
    llm.engine.close()


@pytest.mark.slow
def test_lora_adapters_isolate_in_the_tier(dirs, tmp_path):
    make_adapter(dirs["base"], dirs["root"] / "adapter", seed=3, r=4,
                 target_modules=["q_proj", "v_proj"])
    lora = LoRARequest("a", 1, str(dirs["root"] / "adapter"))
    llm = engine(dirs, "float32", tmp_path, enable_lora=True, max_lora_rank=16)
    base = engine(dirs, "float32", None, enable_prefix_caching=False)
    with_adapter = run(llm, PROMPT, lora=lora)
    flood(llm)
    before = hits(llm)
    plain = run(base, PROMPT)
    assert with_adapter != plain  # the adapter moves the greedy path: the check means something
    assert run(llm, PROMPT) == plain  # the adapter's blocks are not the base's
    assert hits(llm) == before
    flood(llm)
    before = hits(llm)
    assert run(llm, PROMPT, lora=lora) == with_adapter
    assert hits(llm) - before == 10
    llm.engine.close()


def test_a_corrupt_tier_file_is_a_miss(dirs, tmp_path):
    llm = engine(dirs, "float32", tmp_path)
    first = run(llm, PROMPT)
    flood(llm)
    tier = llm.engine.kv_tier
    tier.writer.flush()
    key = llm.engine.kv.hasher(None, PROMPT[:BS])
    path = tier.folder / f"{key.hex()}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of the payload: the checksum catches it
    path.write_bytes(bytes(data))
    before = hits(llm)
    assert run(llm, PROMPT) == first  # recomputed, not read from a bad file
    assert hits(llm) == before
    assert tier.stats.corrupt == 1
    llm.engine.close()


def test_a_failed_restore_fails_only_that_step_and_leaves_nothing_wrong(dirs, tmp_path,
                                                                        monkeypatch):
    import kserve_paged_engine.worker.kv_tier_copy as tier_copy

    llm = engine(dirs, "float32", tmp_path)
    first = run(llm, PROMPT)
    flood(llm)
    real = tier_copy.scatter_blocks

    def broken(*args, **kwargs):
        raise OSError("the tier's volume went away")

    monkeypatch.setattr(tier_copy, "scatter_blocks", broken)
    eng = llm.engine
    eng.add_request("doomed", PROMPT, GREEDY)
    outs = [o for _ in range(3) for o in eng.step() if o.request_id == "doomed"]
    assert outs and outs[-1].finished and "went away" in (outs[-1].error or "")
    assert eng.kv.pool.num_used_blocks == 0  # nothing leaked
    monkeypatch.setattr(tier_copy, "scatter_blocks", real)
    assert run(llm, PROMPT) == first  # no block of the failed restore was left findable
    llm.engine.close()
