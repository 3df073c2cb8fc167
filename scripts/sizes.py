"""Files over 400 lines and functions over 60 lines, in every Python file of the repository.

`python scripts/sizes.py` prints them and exits 1 when any is not excused. It also warns of
files past WARN_FILE_LINES, without failing: that is when a file is split by the jobs it
holds, before the cap would have it trimmed to fit. A function may be
longer when its docstring says why, in a sentence starting "Long because" (or, where the file
is not ours to edit, when FUNCTION_EXCEPTIONS below lists it with its reason); a file may be
longer when FILE_EXCEPTIONS lists it. tests/test_sizes.py holds the count at zero.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
WARN_FILE_LINES = 350  # split by job from here
MAX_FUNCTION_LINES = 60
EXCUSE = "Long because"
# Files allowed past MAX_FILE_LINES: path -> why.
FILE_EXCEPTIONS: dict[str, str] = {}
# Functions allowed past MAX_FUNCTION_LINES, listed here rather than excused in their
# docstrings: "path:qualified name" -> why.
FUNCTION_EXCEPTIONS: dict[str, str] = {
    "kernels/kserve_paged_kernels/triton_backend.py:paged_attention_triton":
        "the kernel's one launch: its grid, split and constexpr choices read together",
}
SKIP_DIRS = {".venv", ".git", "__pycache__", "build", "dist", ".hypothesis", ".pytest_cache"}


@dataclass(frozen=True, slots=True)
class Oversize:
    path: str
    name: str  # "" for a whole file
    lines: int
    excuse: str | None

    def __str__(self) -> str:
        what = f"{self.path}:{self.name}" if self.name else self.path
        return f"{self.lines:5d}  {what}" + (f"  (excused: {self.excuse})" if self.excuse else "")


def python_files(root: Path = REPO) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts))


TRITON_KERNEL = "a Triton kernel (@triton.jit): one GPU program, its tile loops in one body"


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def oversized(root: Path = REPO) -> list[Oversize]:
    found: list[Oversize] = []
    for path in python_files(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            found.append(Oversize(rel, "", n, FILE_EXCEPTIONS.get(rel)))
        for name, node in _functions(ast.parse(text, filename=rel)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                doc = ast.get_docstring(node) or ""
                excuse = (" ".join(doc[doc.index(EXCUSE):].split(".")[0].split())
                          if EXCUSE in doc else FUNCTION_EXCEPTIONS.get(f"{rel}:{name}"))
                if excuse is None and _is_triton_kernel(node):
                    excuse = TRITON_KERNEL
                found.append(Oversize(rel, name, length, excuse))
    return found


def nearing_the_cap(root: Path = REPO) -> list[tuple[int, str]]:
    """Files between WARN_FILE_LINES and MAX_FILE_LINES lines: the ones to split next."""
    sized = ((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in python_files(root))
    return sorted((n, rel) for n, rel in sized if WARN_FILE_LINES < n <= MAX_FILE_LINES)


def main() -> int:
    for n, rel in nearing_the_cap():
        print(f"warning: {rel} has {n} lines (over {WARN_FILE_LINES}): split it by job "
              f"before it reaches {MAX_FILE_LINES}")
    found = oversized()
    files = [o for o in found if not o.name]
    functions = [o for o in found if o.name]
    print(f"files over {MAX_FILE_LINES} lines: {len(files)}")
    for o in files:
        print(o)
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(functions)}")
    for o in functions:
        print(o)
    unexcused = [o for o in found if o.excuse is None]
    print(f"not excused: {len(unexcused)}")
    return 1 if unexcused else 0


if __name__ == "__main__":
    sys.exit(main())
