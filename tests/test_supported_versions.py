"""pyproject's dependency ranges admit the versions the project supports: the GPU image's
(torch 2.11, triton 3.6, transformers 5.17) and whatever is installed here (issue 32, item 8).
Whether our Triton code runs on 3.6 is tests/kernels/test_triton_api.py's question."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from packaging.requirements import Requirement  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
GPU_IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}


def _ranges() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = {r.name: r for r in map(Requirement, deps)}
    return {name: reqs[name] for name in GPU_IMAGE}


@pytest.mark.parametrize("name", sorted(GPU_IMAGE))
def test_range_admits_the_gpu_image_and_the_installed_version(name: str) -> None:
    spec = _ranges()[name].specifier
    assert spec.contains(GPU_IMAGE[name]), f"{name} {GPU_IMAGE[name]} outside {spec}"
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    assert spec.contains(installed, prereleases=True), f"{name} {installed} outside {spec}"


@pytest.mark.parametrize("name", sorted(GPU_IMAGE))
def test_range_has_a_floor(name: str) -> None:
    """A floor at the oldest supported version: nothing older than what was checked."""
    spec = _ranges()[name].specifier
    assert not spec.contains("2.10.0" if name == "torch" else "3.5.0" if name == "triton"
                             else "5.16.0")
