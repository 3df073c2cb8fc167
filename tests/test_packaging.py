"""What `pip install .` (the image, manifests/image/Dockerfile) installs: every folder of code
is a package that setuptools finds, so none is left out of a non-editable install."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "kserve_paged")


def test_every_folder_of_code_is_installed() -> None:
    found = set(find_packages(where=str(REPO), include=[f"{p}*" for p in PACKAGES]))
    folders = {".".join(path.parent.relative_to(REPO).parts) for pkg in PACKAGES
               for path in (REPO / pkg).rglob("*.py")}
    assert folders - found == set()
