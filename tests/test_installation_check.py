"""kserve_paged_engine.frontend.installation: a broken environment is named in words at start-up (what is
wrong, how to fix it), before transformers can fail with a traceback from inside itself."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kserve_paged_engine.frontend import installation
from tests.helpers.layout import REPO


def _dist_info(root: Path, name: str, version: str, top_level: str = "") -> Path:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level:
        (info / "top_level.txt").write_text(top_level)
    return info


def test_another_distribution_owning_one_of_our_names_is_named() -> None:
    owners = {"kserve_paged_kernels": ["kserve-paged", "evil-kernels"],
              "kserve_paged": ["kserve-paged"], "kernels": ["kernels"]}
    (message,) = installation.name_clashes(owners)
    assert "`kserve_paged_kernels`" in message and "evil-kernels" in message
    assert installation.name_clashes({"kernels": ["kernels", "kserve-paged"]}) == []


def test_an_older_install_of_ours_declaring_kernels_is_named(tmp_path: Path) -> None:
    info = _dist_info(tmp_path, "kserve-paged", "0.1.0", "engine\nkernels\nkserve_paged\n")
    messages = installation.stale_names([metadata.PathDistribution(info)])
    assert [m.split("`")[1] for m in messages] == ["engine", "kernels"]
    assert all(str(info) in m for m in messages)
    current = _dist_info(tmp_path / "new", "kserve-paged", "0.1.0",
                         "\n".join(installation.PACKAGES))
    assert installation.stale_names([metadata.PathDistribution(current)]) == []


def test_installed_versions_outside_the_ranges_are_named() -> None:
    """Absent ones are not: several load only with their feature (the GPU image has no kserve),
    and their own import error names them."""
    reqs = ["transformers>=5.17,<6", "torch<2.14,>=2.11", "kserve>=0.21",
            'opentelemetry-sdk<1; extra == "tracing"', "not a requirement ("]
    found = installation.version_problems(
        reqs, {"transformers": "4.57.0", "torch": "2.13.0+cpu", "kserve": None,
               "opentelemetry-sdk": "1.30.0"})
    assert found == ["transformers 4.57.0 is installed; kserve-paged supports "
                     "transformers<6,>=5.17"]


def test_this_environment_has_no_problem() -> None:
    assert installation.problems() == []


@pytest.mark.parametrize("planted, expected", [
    # A distribution that also ships one of our import names.
    (("evil-kernels", "1.0", "kserve_paged_kernels\n"),
     "the import name `kserve_paged_kernels` is provided by evil-kernels"),
    # transformers older than our range, found first on the path.
    (("transformers", "4.57.0", ""), "transformers 4.57.0 is installed; kserve-paged supports"),
])
def test_the_entry_points_say_what_is_wrong_and_exit(tmp_path: Path, planted: tuple,
                                                     expected: str) -> None:
    _dist_info(tmp_path, *planted)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for argv in (["-m", "kserve_paged_engine", "generate", "x"],
                 ["-m", "kserve_paged", "--model_name", "m"]):
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert expected in proc.stderr and "Fix:" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_a_check_that_cannot_run_warns_and_lets_the_process_go_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def unreadable() -> list[str]:
        raise KeyError("Name")

    monkeypatch.setattr(installation, "problems", unreadable)
    installation.check_or_exit()  # returns: no SystemExit
    assert "the installation check could not run: KeyError" in capsys.readouterr().err
