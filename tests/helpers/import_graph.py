"""The project's imports as a graph of files, read from the source (nothing is imported).

Every import counts, wherever it stands: at the top of a module, inside a function, or under
`if TYPE_CHECKING:` (a layer a module names only in its annotations is still a layer it leans
on). `from package import name` points at the submodule `name` when there is one, else at the
package's `__init__.py`. A module importing its own package (or a package above it) draws no
arrow: Python runs a package's `__init__.py` before any module inside it anyway.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.layout import PACKAGES, REPO, module_file, python_files


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing file, relative to the repository ("engine/kserve_paged_engine/frontend/llm.py")
    target: str  # the imported project file
    line: int


def project_files() -> list[str]:
    return [str(p.relative_to(REPO)) for p in python_files()]


def _module_file(module: str) -> str | None:
    """The file that defines a dotted module name of the project, if any (repository-relative)."""
    path = module_file(module)
    return None if path is None else str(path.relative_to(REPO))


def _module_of(file: str) -> str:
    """The dotted module name of a project file."""
    path = (REPO / file).resolve()
    for folder in PACKAGES.values():
        if path.is_relative_to(folder):
            return ".".join(path.relative_to(folder.parent).with_suffix("").parts)
    raise ValueError(f"{file} is in none of the packages")


def _package_of(file: str) -> str:
    return _module_of(file).rsplit(".", 1)[0]


def imports_of(file: str) -> list[Import]:
    tree = ast.parse((REPO / file).read_text(), filename=file)
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _module_file(alias.name)
                if alias.name.split(".")[0] in PACKAGES and target is not None:
                    found.append(Import(file, target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the importing file's package
                base = _package_of(file).split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                target = _module_file(f"{module}.{alias.name}") or _module_file(module)
                if target is not None:
                    found.append(Import(file, target, node.lineno))
    return found


def _own_package(source: str, target: str) -> bool:
    return target.endswith("__init__.py") and source.startswith(str(Path(target).parent) + "/")


def import_graph() -> dict[str, list[Import]]:
    return {f: [i for i in imports_of(f) if not _own_package(i.source, i.target)]
            for f in project_files()}


def circles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Groups of two or more files that import each other in a loop (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for imp in graph.get(v, []):
            w = imp.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
