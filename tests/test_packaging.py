"""What `pip install .` (the image, manifests/image/Dockerfile) installs: every folder of code
is a package that setuptools finds in pyproject's source roots, so none is left out of a
non-editable install, and the native kernels' C sources travel with it as package data."""

from __future__ import annotations

import tomllib
from setuptools import find_packages

from tests.helpers.layout import PACKAGES, REPO, SOURCE_ROOTS

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_folder_of_code_is_installed() -> None:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    found = {pkg for root in SOURCE_ROOTS for pkg in find_packages(where=str(root),
                                                                     include=include)}
    folders = {".".join(path.parent.relative_to(folder.parent).parts)
               for folder in PACKAGES.values() for path in folder.rglob("*.py")}
    assert folders - found == set()
    assert set(PACKAGES) == {"kserve_paged", "kserve_paged_engine", "kserve_paged_kernels"}


def test_the_native_sources_are_package_data() -> None:
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["kserve_paged_kernels"]
    csrc = PACKAGES["kserve_paged_kernels"]
    covered = {p for pattern in patterns for p in csrc.glob(pattern)}
    sources = {p for p in (csrc / "csrc").iterdir() if p.suffix in (".c", ".h")}
    assert sources and sources <= covered
