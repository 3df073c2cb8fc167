"""No Python file over 400 lines and no function over 60 without its reason: the count of
scripts/sizes.py (docs/contributing.md) held at zero."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scripts_sizes", REPO / "scripts" / "sizes.py")
sizes = importlib.util.module_from_spec(_spec)
sys.modules["scripts_sizes"] = sizes  # its dataclass looks its module up there
_spec.loader.exec_module(sizes)


def test_nothing_is_oversized_without_a_reason() -> None:
    unexcused = [str(o) for o in sizes.oversized() if o.excuse is None]
    assert unexcused == [], "\n".join(unexcused)


def test_the_count_sees_a_long_file_and_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n" + "\n" * 340)
    (tmp_path / "excused.py").write_text(textwrap.dedent('''\
        def g():
            """Long because the test says so."""
        ''') + body + "\n")
    found = {(o.path, o.name): o for o in sizes.oversized(tmp_path)}
    assert found[("long.py", "")].lines > 400
    assert found[("long.py", "f")].excuse is None
    assert found[("excused.py", "g")].excuse == "Long because the test says so"
