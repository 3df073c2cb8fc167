"""bench/gpu_engine.py (issue 7's GPU run) checked end to end on CPU with --dry-run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_gpu_engine_dry_run_writes_rates_and_decode_floors(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_engine
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "gpu_engine.json"
    assert gpu_engine.main(["--dry-run", "--models", "llama3-8b", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["requests"] == 4 and result["copy_gbs"] > 0
    entry = result["models"]["llama3-8b"]
    engine, hf = entry["engine"], entry["transformers"]
    assert engine["output_tokens"] == hf["output_tokens"] == 4 * 8
    assert engine["output_tok_s"] > 0 and hf["output_tok_s"] > 0
    assert abs(entry["ratio"] - engine["output_tok_s"] / hf["output_tok_s"]) < 1e-9
    steps = engine["decode_steps"]
    assert steps and sum(b["steps"] for b in steps) >= 7  # 8 tokens: 1 prefill + 7 decodes
    for b in steps:
        assert b["median_ms"] > 0 and b["floor_bytes"] > 0
        assert abs(b["floor_ratio"] - b["floor_ms"] / b["median_ms"]) < 1e-9
    assert "| llama3-8b |" in capsys.readouterr().out
    assert gpu_engine.main(["--dry-run", "--models", "nope"]) == 2
