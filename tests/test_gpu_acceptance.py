"""bench/gpu_acceptance.py: its dry run passes every stage on CPU without the packages the
minimal GPU image lacks (pytest included); a failing, hanging or overrunning stage costs
itself only; the plan it prints is what it runs, and fits 9 minutes.
(The preflight, the kernel tests' stage and the runner: tests/test_gpu_acceptance_stages.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.acceptance_run import acceptance_modules, bench_module, fake_stages
from tests.helpers.minimal_image import minimal_image_site


@pytest.mark.slow
@pytest.mark.timeout(2400)  # every stage interpreted in turn: minutes each on a shared CPU
def test_dry_run_passes_every_stage_without_the_missing_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acceptance, stages, _ = acceptance_modules()
    monkeypatch.setenv("PYTHONPATH", str(minimal_image_site(tmp_path / "site")))
    out = tmp_path / "out"
    rc = acceptance.main(["--dry-run", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    summary = json.loads((out / "summary.json").read_text())
    names = {s.name for s in stages.STAGES}
    assert summary["stages"] == dict.fromkeys(names, "pass"), summary
    assert rc == 0 and summary["ok"] and summary["complete"] and summary["dry_run"]
    assert summary["preflight"].startswith("preflight: ok")
    results = {name: json.loads((out / f"{name}.json").read_text())
               for name in names | {"preflight"}}

    def data(stage: str, part: str | None = None) -> dict:
        return results[stage]["parts"][part or stage]["data"]

    versions = data("preflight")["versions"]
    assert all(versions["supported"].values())
    assert versions["importable"] == {"kserve": False, "gguf": False}  # the block held
    kernel = results["kernel-tests"]
    assert kernel["tests"]["passed"] >= 3 and set(kernel["tests"]) == {"passed"}
    assert len(kernel["parts"]) == 2  # the shards
    grid = results["gpu-path"]["parts"]["grid-0"]["tests"]
    assert grid and {t["outcome"] for t in grid.values()} == {"skipped"}  # it needs CUDA
    for dtype in ("float32", "bfloat16"):
        equality = results["engine-equality"]["parts"][f"{dtype}/llama"]
        assert equality["data"]["results"]["llama/graphs"]["ok"]
        assert equality["tests"]["llama/host-tier"]["outcome"] == "passed"  # seen as it ran
    assert data("gpu-path", "launch-count")["llama"]["layer"]["total"] <= 12
    assert data("gpu-path", "host-syncs")["decode"]["total"] == 1
    assert data("gpu-path", "big-kv")["splits"]["32"]["padded_zero"]
    assert data("decode-8b")["runs"]["eager"]["steps"][0]["batch"] == 1
    assert data("decode-smol")["runs"]["eager"]["steps"][0]["batch"] == 1
    w1 = data("w1-8b")
    assert w1["engine"]["complete"] and len(w1["engine"]["passes"]) == 2 and w1["ratio"] > 0
    step = data("profile-step")
    assert step["eager"]["triton_launches"] > 0 and step["graphs"]["launches_counted"] > 0
    assert step["eager"]["gpu_busy_fraction"] is None and "no CUDA" in step["measured"]


def test_a_failing_or_hanging_stage_does_not_stop_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acceptance, _, _ = acceptance_modules()
    fake_stages(monkeypatch, [
        ("fails", "import sys; sys.exit(3)", 5),
        # Its grandchild holds stdout open past the kill: the run must not wait for it.
        ("hangs", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                  "'import time; time.sleep(60)']); time.sleep(60)", 2),
        ("bad-json", "print('not json')", 20, {"parse_json": True}),
        ("judged", "print('{\"n\": 13}')", 20,
         {"parse_json": True, "judge": lambda d: "too many" if d["n"] > 12 else None}),
        ("passes", "print('{\"n\": 1}')", 20, {"parse_json": True}),
    ])
    out = tmp_path / "out"
    assert acceptance.main(["--out", str(out), "--cache-dir", str(tmp_path / "c")]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"] == {"fails": "fail", "hangs": "timeout", "bad-json": "error",
                                 "judged": "fail", "passes": "pass"}
    assert summary["seconds"] < 30 and summary["complete"]
    assert json.loads((out / "passes.json").read_text())["parts"]["passes"]["data"] == {"n": 1}
    assert json.loads((out / "judged.json").read_text())["why"] == "judged: too many"
    assert acceptance.main(["--out", str(out), "--stages", "nope"]) == 2


def test_a_stage_that_overruns_does_not_shorten_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage killed at its limit (and so a little past it) leaves the next stage its whole
    budget, and one that ends early lends nothing: each limit is the stage's own."""
    acceptance, _, _ = acceptance_modules()
    fake_stages(monkeypatch, [
        ("overruns", "import time; time.sleep(60)", 1),
        ("next", "print('{\"n\": 1}')", 5, {"parse_json": True}),
        ("early", "pass", 30),
        ("after-early", "pass", 4),
    ])
    out = tmp_path / "out"
    acceptance.main(["--out", str(out), "--cache-dir", str(tmp_path / "c")])
    limits = {name: json.loads((out / f"{name}.json").read_text())["timeout_s"]
              for name in ("overruns", "next", "early", "after-early")}
    assert limits == {"overruns": 1, "next": 5, "early": 30, "after-early": 4}
    assert json.loads((out / "next.json").read_text())["status"] == "pass"


def test_the_plan_fits_nine_minutes_and_is_what_the_run_executes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    acceptance, stages, _ = acceptance_modules()
    assert acceptance.main(["--plan"]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]]
    planned = [(name, int(limit)) for name, limit in rows[:-1]]
    assert rows[-1][0] == "total" and int(rows[-1][1]) == sum(s for _, s in planned)
    assert sum(s for _, s in planned) <= stages.LIMIT_S == 9 * 60
    assert [n for n, _ in planned] == ["preflight", *(s.name for s in stages.STAGES)]
    ran = []

    def run_stage(stage, ctx, folder, limit, write):  # noqa: ANN001, ANN202 - the runner's
        ran.append((stage.name, limit))
        result = {"stage": stage.name, "status": "pass", "seconds": 0.0, "parts": {}}
        write(result)
        return result

    monkeypatch.setattr(acceptance, "run_stage", run_stage)
    monkeypatch.setattr(acceptance.preflight, "toolchain_problem", lambda env=None: None)
    monkeypatch.setattr(acceptance.preflight, "one_line", lambda result: "preflight: ok")
    assert acceptance.main(["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")]) == 0
    assert ran == planned


def test_the_engine_stage_runs_every_model_of_engine_equality() -> None:
    _, stages, _ = acceptance_modules()
    assert tuple(bench_module("engine_equality").MODELS) == stages.ENGINE_MODELS


def test_gpu_check_sizes_an_8b_layer_on_the_gpu_with_or_without_contexts() -> None:
    gpu_check = bench_module("gpu_check")
    layer = (gpu_check.HEADS, gpu_check.KV_HEADS, gpu_check.HEAD_DIM, gpu_check.BLOCK)
    assert gpu_check.sizes(False, None) == (4 << 30, gpu_check.BATCHES, gpu_check.CONTEXTS,
                                            layer)
    assert gpu_check.sizes(False, "512,4096")[2:] == ((512, 4096), layer)
    tiny = gpu_check.sizes(True, "64")
    assert tiny[2] == (64,) and tiny[3][0] < gpu_check.HEADS  # the dry run stays tiny


def test_the_decode_smol_shape_is_the_default_models(tmp_path: Path) -> None:
    """The graphs-against-eager target is for the default model's shape: the stage's config
    must be that model's, field for field, as transformers reads both."""
    from transformers import AutoConfig

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    decode_8b = bench_module("decode_8b")
    real = AutoConfig.from_pretrained(ensure_default_model(progress=lambda _: None))
    built = AutoConfig.from_pretrained(decode_8b.model_folder(decode_8b.SMOLLM2_135M,
                                                              tmp_path / "m"))
    assert real.rope_parameters["rope_theta"] == built.rope_parameters["rope_theta"]
    for key in set(decode_8b.SMOLLM2_135M) - {"rope_theta"}:
        assert getattr(built, key) == getattr(real, key), key
