"""requirements.lock: one locked set of versions that set-up, CI and the image install, inside
pyproject.toml's ranges, and installed here as locked (docs/packaging.md)."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.layout import REPO

LOCK = REPO / "requirements.lock"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line.strip())
        assert match, f"not a pin: {line!r}"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def _requirements() -> list[Requirement]:
    lines = list(PROJECT["dependencies"])
    for extra in ("dev", "bench", "tracing"):
        lines += PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines
            if canonicalize_name(Requirement(line).name) != "kserve-paged"]


def test_every_requirement_is_pinned_inside_its_range() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_torch_is_pinned_without_a_build_label() -> None:
    """One line for the CPU and the CUDA builds (2.13.0 matches 2.13.0+cpu and +cu128)."""
    assert "+" not in _pins()["torch"]


def test_set_up_and_the_image_install_the_lock() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'LOCK=requirements.lock' in setup and 'PIN=(-c "$LOCK")' in setup
    assert setup.count('"${PIN[@]}"') >= 4  # torch, the project, the two model packages
    dockerfile = (REPO / "manifests" / "image" / "Dockerfile").read_text()
    assert "requirements.lock" in dockerfile
    assert (REPO / ".ci" / "run").read_text().count("scripts/test.sh") == 1


def test_this_environment_is_the_locked_one() -> None:
    if Path(sys.prefix, ".kserve-paged-installed.newest").exists():
        pytest.skip("set up with --newest (scripts/lock.sh's scratch environment)")
    differ = {}
    for name, pinned in _pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            differ[name] = (pinned, None)
            continue
        if installed.split("+")[0] != pinned.split("+")[0]:
            differ[name] = (pinned, installed)
    assert differ == {}, "installed versions differ from requirements.lock: run scripts/setup.sh"
