"""Where the project's packages live in a checkout, read from pyproject.toml (their one home).

engine/ and kernels/ are source roots holding `kserve_paged_engine` and `kserve_paged_kernels`;
the repository root holds `kserve_paged` (docs/packaging.md says why).
"""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
_FIND = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
SOURCE_ROOTS: tuple[Path, ...] = tuple((REPO / where).resolve() for where in _FIND["where"])
# Top-level import name -> its folder.
PACKAGES: dict[str, Path] = {name: root / name for name in _FIND["include"] if "." not in name
                             for root in SOURCE_ROOTS if (root / name / "__init__.py").is_file()}


def pythonpath() -> str:
    """PYTHONPATH for a child that imports this checkout without the package installed."""
    return os.pathsep.join(str(root) for root in SOURCE_ROOTS)


def module_file(module: str) -> Path | None:
    """The file that defines a dotted module name of the project, if any."""
    top, *rest = module.split(".")
    if top not in PACKAGES:
        return None
    path = PACKAGES[top].joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def python_files() -> list[Path]:
    """Every Python file of the three packages."""
    return sorted(p for folder in PACKAGES.values() for p in folder.rglob("*.py"))
