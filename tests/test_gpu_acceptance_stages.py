"""The acceptance run's pieces (bench/acceptance/): the preflight stops the run with one line
naming what is missing; the kernel tests run under the pytest the tree carries, without the
image's; a stage killed at its limit has already written each test that passed; the
children never build the native CPU library."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.acceptance_run import acceptance_modules, bench_module, fake_stages
from tests.helpers.minimal_image import minimal_image_site

FAKE_TESTS = '''\
import time

import pytest


def test_a():
    assert "site-packages" not in pytest.__file__  # the carried pytest, not the image's


@pytest.mark.parametrize("n", [1, 2])
def test_b(n):
    assert n


def test_c_hangs():
    time.sleep(120)
'''


def _run_stage(tmp_path: Path, parts: Any, limit: int) -> list[dict[str, Any]]:
    """A one-off stage through the runner; each JSON it wrote, the last one last."""
    _, _, runner = acceptance_modules()
    stage = runner.Stage("one-off", "a test's", limit, limit, parts)
    ctx = runner.Context(dry_run=False, cache_dir=tmp_path / "cache")
    ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    written: list[dict[str, Any]] = []
    runner.run_stage(stage, ctx, tmp_path / "logs", limit,
                     lambda data: written.append(json.loads(json.dumps(data))))
    return written


def _pytest_parts(tests: Path, shards: int) -> Any:
    kernel_tests = bench_module("acceptance.kernel_tests")
    return lambda ctx, folder: kernel_tests.pytest_parts(ctx, folder, [str(tests)], None, shards)


def test_a_missing_compiler_stops_the_run_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    acceptance, _, _ = acceptance_modules()
    fake_stages(monkeypatch, [("never", "print('ran')", 5)], preflight_passes=False)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # neither gcc nor clang nor cc
    monkeypatch.delenv("CC", raising=False)
    out = tmp_path / "out"
    assert acceptance.main(["--out", str(out), "--cache-dir", str(tmp_path / "c")]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight failed: no C compiler"), lines
    assert "gcc" in lines[0] and "CC" in lines[0]
    assert not (out / "never.json").exists()  # nothing ran after the preflight
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preflight"] == lines[0] and summary["complete"] and not summary["ok"]
    monkeypatch.setenv("CC", "no-such-cc -O2")
    assert acceptance.main(["--preflight"]) == 3
    assert capsys.readouterr().out.startswith("preflight failed: no C compiler: CC='no-such-cc")


def test_a_missing_python_h_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sysconfig

    preflight = bench_module("acceptance.preflight")
    if shutil.which("gcc") is None and shutil.which("clang") is None:
        monkeypatch.setenv("CC", sys.executable)  # any executable: the compiler is not the point
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **kw: {**real(*a, **kw),
                                                                  "include": str(tmp_path)})
    assert preflight.toolchain_problem() == (
        f"no {tmp_path / 'Python.h'} (Triton's kernel launchers include it): install the "
        f"headers of Python {sysconfig.get_python_version()} (python3-dev)")
    (tmp_path / "Python.h").write_text("")
    assert preflight.toolchain_problem() is None


def test_without_a_gpu_the_preflight_says_so_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    acceptance, _, _ = acceptance_modules()
    if acceptance.preflight.toolchain_problem() is not None:
        pytest.skip("no compiler here: the toolchain check answers first")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path even on a GPU host
    assert acceptance.main(["--preflight", "--cache-dir", str(tmp_path / "c")]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight failed: torch "), lines
    assert lines[0].endswith("sees no CUDA device")


def test_the_kernel_stage_runs_without_the_images_pytest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(minimal_image_site(tmp_path / "site")))
    tests = tmp_path / "t" / "test_fake.py"
    tests.parent.mkdir()
    tests.write_text(FAKE_TESTS.replace("def test_c_hangs", "def _not_a_test"))
    last = _run_stage(tmp_path, _pytest_parts(tests, 2), 120)[-1]
    assert last["status"] == "pass", last.get("why") or last["parts"]
    assert last["tests"] == {"passed": 3}
    assert {len(p["tests"]) for p in last["parts"].values()} == {1, 2}  # shared out


def test_a_stage_killed_at_its_limit_has_written_each_test_that_passed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, runner = acceptance_modules()
    monkeypatch.setattr(runner, "WRITE_EVERY_S", 0.3)
    tests = tmp_path / "t" / "test_fake.py"
    tests.parent.mkdir()
    tests.write_text(FAKE_TESTS)
    written = _run_stage(tmp_path, _pytest_parts(tests, 1), 12)
    last = written[-1]
    assert last["status"] == "timeout" and last["parts"]["shard-0"]["status"] == "timeout"
    outcomes = {name.split("::")[-1]: t["outcome"]
                for name, t in last["parts"]["shard-0"]["tests"].items()}
    assert outcomes == {"test_a": "passed", "test_b[1]": "passed", "test_b[2]": "passed",
                        "test_c_hangs": "killed"}
    while_running = [w for w in written if w["status"] == "running"]
    assert while_running[-1]["tests"] == {"passed": 3, "running": 1}  # before the kill


def test_the_stages_children_leave_the_native_library_unbuilt(tmp_path: Path) -> None:
    _, _, runner = acceptance_modules()
    code = ("import json; from kserve_paged_kernels import settings; "
            "print(json.dumps({'native': settings.native_enabled()}))")
    parts = lambda ctx, folder: [runner.Part("native", [sys.executable, "-c", code],  # noqa: E731
                                             parse_json=True)]
    last = _run_stage(tmp_path, parts, 120)[-1]
    assert last["status"] == "pass", last["parts"]
    assert last["parts"]["native"]["data"] == {"native": False}


def test_shards_share_tests_out_and_keep_a_whole_file_together() -> None:
    plugin = bench_module("acceptance.pytest_plugin.acceptance_record")
    ids = ["a.py::t[1]", "a.py::t[2]", "b.py::x", "b.py::y", "a.py::u", "c.py::z"]
    assert plugin.shard_of(ids, set(), 2) == [0, 1, 0, 1, 0, 1]
    assert plugin.shard_of(ids, {"b.py"}, 2) == [0, 1, 0, 0, 1, 0]


def test_the_carried_wheels_are_the_pinned_ones(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_tests = bench_module("acceptance.kernel_tests")
    folder = kernel_tests.vendored_pytest(tmp_path)
    assert (folder / "pytest" / "__init__.py").is_file() and (folder / "pluggy").is_dir()
    assert kernel_tests.vendored_pytest(tmp_path) == folder  # unpacked once
    wheels = tmp_path / "wheels"
    shutil.copytree(kernel_tests.WHEEL_DIR, wheels)
    with (wheels / next(iter(kernel_tests.WHEELS))).open("ab") as f:
        f.write(b"tampered")
    monkeypatch.setattr(kernel_tests, "WHEEL_DIR", wheels)
    with pytest.raises(ValueError, match="not the pinned wheel"):
        kernel_tests.vendored_pytest(tmp_path / "other")
