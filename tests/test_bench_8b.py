"""bench/decode_8b.py and bench/w1_8b.py, the parts that decide what a GPU run records: the
decode run's KV cache holds its largest batch (a preempted step is not a decode step), and W1's
engine figures are on stdout before the transformers peer starts (a peer killed at its time
limit must not take them along)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kserve_paged_engine.core.kv_sizing import kv_bytes_per_block

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(("shape", "batches", "prompt", "steps"), [
    ("llama3-8b", [1, 16, 64, 256], 512, 20),  # the acceptance run's
    ("smollm2", [1, 2, 4, 8, 16], 512, 20),
    ("llama3-8b", [300], 1000, 40),
])
def test_the_decode_runs_cache_holds_its_largest_batch_at_full_length(
        shape: str, batches: list[int], prompt: int, steps: int) -> None:
    decode_8b = _bench("decode_8b")
    facts = decode_8b.SHAPES[shape]
    for graphs in (False, True):
        kw = decode_8b.engine_kwargs(batches, prompt, steps, "cuda", graphs)
        block = kw["block_size"]
        if "num_kv_blocks" in kw:
            blocks = kw["num_kv_blocks"]
        else:  # a byte budget: what it holds, at the model's bytes per block
            blocks = kw["kv_cache_memory"] // kv_bytes_per_block(
                facts["num_hidden_layers"], facts["num_key_value_heads"], facts["head_dim"],
                block, 2)
        longest = prompt + steps + decode_8b.SPARE_TOKENS  # a request's tokens at its end
        assert kw["max_model_len"] >= longest and kw["max_num_seqs"] >= max(batches)
        assert blocks >= max(batches) * -(-longest // block)
    gib = decode_8b.kv_cache_bytes(facts, kw) / 2**30
    if shape == "llama3-8b" and batches == [1, 16, 64, 256]:
        assert 16 < gib < 40  # more than the 16 GiB that preempted, well inside an H200


def test_w1_prints_the_engines_figures_before_the_peer_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine pass stood in for (its figures are not what is tested here); the peer finds
    them on stdout already, then fails: the result keeps the engine's figures and says why."""
    w1 = _bench("w1_8b")
    engine = {"passes": [{"output_tok_s": 10.0}, {"output_tok_s": 12.0}], "complete": True}
    seen: list[str] = []

    def peer(*args: object) -> dict:
        seen.append(capsys.readouterr().out)
        raise TimeoutError("the peer overran")

    monkeypatch.setattr(w1, "run_engine", lambda *args: engine)
    monkeypatch.setattr(w1, "run_peer", peer)
    result = w1.run(tiny=True, peer=True, num_prompts=1, max_tokens=2)
    (line,) = seen[0].strip().splitlines()
    assert json.loads(line)["engine"] == engine and json.loads(line)["partial"]
    assert result["engine"] == engine and result["ok"]
    assert "TimeoutError" in result["transformers"]["error"] and "ratio" not in result
