"""bench/gpu_acceptance.py: its dry run passes every stage on CPU without the packages the
minimal GPU image lacks, and a failing or hanging stage never stops the stages after it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
# Not on the minimal GPU image (issue 32): the children of the dry run must not need them.
ABSENT = ("kserve", "gguf", "fastapi", "xgrammar", "zmq", "cbor2", "uvicorn")


def _acceptance():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_acceptance
    finally:
        sys.path.remove(str(BENCH))
    return gpu_acceptance


def _block_imports(folder: Path) -> Path:
    """A sitecustomize that makes ABSENT unimportable in every child that puts `folder` on its
    path (the runner passes PYTHONPATH on)."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"ABSENT = {ABSENT!r}\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (minimal image)')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Absent())\n")
    return folder


@pytest.mark.slow
@pytest.mark.timeout(2400)  # every stage interpreted in turn: minutes each on a shared CPU
def test_dry_run_passes_every_stage_without_the_missing_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acceptance = _acceptance()
    monkeypatch.setenv("PYTHONPATH", str(_block_imports(tmp_path / "site")))
    out = tmp_path / "out"
    rc = acceptance.main(["--dry-run", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    summary = json.loads((out / "summary.json").read_text())
    stages = {s.name for s in acceptance.STAGES}
    assert summary["stages"] == dict.fromkeys(stages, "pass"), summary
    assert rc == 0 and summary["ok"] and summary["dry_run"]
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in stages}
    versions = results["versions"]["data"]
    assert all(versions["supported"].values())
    assert versions["importable"] == {"kserve": False, "gguf": False}  # the block held
    assert "passed" in results["kernel-tests"]["output_tail"]
    assert results["launch-count"]["data"]["llama"]["layer"]["total"] <= 12
    assert results["engine-equality"]["data"]["results"]["llama/graphs"]["ok"]
    assert results["engine-equality"]["data"]["results"]["llama/host-tier"]["ok"]
    assert results["engine-equality-bf16"]["data"]["results"]["llama/graphs"]["ok"]
    assert results["host-syncs"]["data"]["decode"]["total"] == 1
    assert results["big-kv"]["data"]["splits"]["32"]["padded_zero"]
    assert results["decode-8b"]["data"]["runs"]["eager"]["steps"][0]["batch"] == 1
    assert results["decode-smol"]["data"]["runs"]["eager"]["steps"][0]["batch"] == 1
    w1 = results["w1-8b"]["data"]
    assert w1["engine"]["complete"] and len(w1["engine"]["passes"]) == 2 and w1["ratio"] > 0
    step = results["profile-step"]["data"]
    assert step["eager"]["triton_launches"] > 0 and step["graphs"]["launches_counted"] > 0
    assert step["eager"]["gpu_busy_fraction"] is None and "no CUDA" in step["measured"]


def test_a_failing_or_hanging_stage_does_not_stop_the_run(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    acceptance = _acceptance()
    py = sys.executable

    def stage(name: str, code: str, budget: int = 20, **kw):
        return acceptance.Stage(name, lambda a: [py, "-c", code], budget, **kw)

    monkeypatch.setattr(acceptance, "STAGES", [
        stage("fails", "import sys; sys.exit(3)", budget=1),
        # Its grandchild holds stdout open past the kill: the run must not wait for it.
        stage("hangs", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                       "'import time; time.sleep(60)']); time.sleep(60)", budget=2),
        stage("bad-json", "print('not json')", parse_json=True),
        stage("judged", "print('{\"n\": 13}')", parse_json=True,
              judge=lambda d: "too many" if d["n"] > 12 else None),
        stage("passes", "print('{\"n\": 1}')", parse_json=True),
    ])
    out = tmp_path / "out"
    assert acceptance.main(["--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"] == {"fails": "fail", "hangs": "timeout", "bad-json": "error",
                                 "judged": "fail", "passes": "pass"}
    assert summary["seconds"] < 20 and summary["budget_s"] == 63
    hangs = json.loads((out / "hangs.json").read_text())
    assert 2 <= hangs["timeout_s"] <= 3  # its budget and what "fails" left unused
    assert json.loads((out / "passes.json").read_text())["data"] == {"n": 1}
    assert json.loads((out / "judged.json").read_text())["why"] == "too many"
    assert acceptance.main(["--out", str(out), "--stages", "nope"]) == 2


def test_stage_budgets_fit_eight_minutes_and_pass_on_what_is_unused() -> None:
    acceptance = _acceptance()
    budgets = [s.budget for s in acceptance.STAGES]
    assert sum(budgets) == acceptance.TOTAL_BUDGET_S <= 8 * 60 - 10
    assert len({s.name for s in acceptance.STAGES}) == len(budgets) and min(budgets) > 0
    limit = acceptance.time_limit
    assert limit([10, 20, 30], []) == 10
    assert limit([10, 20, 30], [4]) == 26  # 6 s left by the first
    assert limit([10, 20, 30], [4, 26]) == 30  # none left: the third keeps its own
    assert limit([10, 20], [12]) == 18  # a stage killed a little late: the next pays
    assert limit([10, 20], [40]) == 1


def test_the_decode_smol_shape_is_the_default_models(tmp_path: Path) -> None:
    """The graphs-against-eager target is for the default model's shape: the stage's config
    must be that model's, field for field, as transformers reads both."""
    from transformers import AutoConfig

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    sys.path.insert(0, str(BENCH))
    try:
        import decode_8b
    finally:
        sys.path.remove(str(BENCH))
    real = AutoConfig.from_pretrained(ensure_default_model(progress=lambda _: None))
    built = AutoConfig.from_pretrained(decode_8b.model_folder(decode_8b.SMOLLM2_135M,
                                                              tmp_path / "m"))
    assert real.rope_parameters["rope_theta"] == built.rope_parameters["rope_theta"]
    for key in set(decode_8b.SMOLLM2_135M) - {"rope_theta"}:
        assert getattr(built, key) == getattr(real, key), key
