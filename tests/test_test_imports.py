"""No module under tests/ imports a test module: what tests share lives in tests/helpers/.

Why: importing a test module runs its module-level setup and re-collects its fixtures and
tests under another name, ties one file's edits to another's, and a shared piece kept in a
test file has no name that says its job. Imports are read with ast (function-level and
relative ones included), so a guard that only greps `from tests.test_` cannot be dodged.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _test_module_of(dotted: str) -> str | None:
    """The test module (tests/**/test_*.py) a dotted name is or lies inside, or None; a
    helper's function named `test_...` is not one, as no file by that name exists."""
    parts = dotted.split(".")
    if parts[0] != "tests":
        return None
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("test_") and (ROOT / Path(*parts[: i + 1])).with_suffix(".py").is_file():
            return ".".join(parts[: i + 1])
    return None


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules that `source` (the module named `module`, for relative imports)
    imports anywhere in its body, sorted."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(m for m in map(_test_module_of, names) if m is not None)
    return sorted(found)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        name = _module_name(path)
        if imported := [m for m in imported_test_modules(path.read_text(), name) if m != name]:
            offenders[str(path.relative_to(ROOT))] = imported
    assert offenders == {}, "move what they share into tests/helpers/"


@pytest.mark.parametrize("source", [
    "from tests.test_scheduler import step\n",
    "import tests.test_scheduler\n",
    "from tests import test_scheduler\n",
    "from tests.kernels.test_decoder_stack import DECLINED\n",
    "from tests.kernels import test_decoder_stack as stack\n",
    "from .test_scheduler import step\n",  # relative, from a module in tests/
    "def test_x():\n    from tests.test_scheduler import step\n",  # function-level
])
def test_the_guard_sees_a_planted_import(source: str) -> None:
    want = "tests.kernels.test_decoder_stack" if "kernels" in source else "tests.test_scheduler"
    assert imported_test_modules(source, "tests.test_planted") == [want]


@pytest.mark.parametrize("source", [
    "from tests.helpers.core import make_request\n",
    "from tests.helpers import core\n",
    "from tests.kernels.interpreted import run_calls\n",
    "from tests.helpers.core import test_not_a_module\n",  # a name, not a file
    "import pytest\n",
])
def test_the_guard_lets_helpers_through(source: str) -> None:
    assert imported_test_modules(source, "tests.test_planted") == []
