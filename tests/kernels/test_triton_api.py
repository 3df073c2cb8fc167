"""Our Triton code uses only APIs that Triton 3.6 (the GPU image's) and the installed Triton
both have.

Every Python file of the repository that imports `triton` is parsed: each `triton.x.y` / `tl.x`
name it reaches through its imports (and each keyword it passes to such a callable), and inside
`@triton.jit` functions each attribute taken on a value (`x.to`, `ptr.dtype.element_ty`), must be
in `tests/data/triton_api_3.6.0.json` (what Triton 3.6.0 exposes, written by
scripts/triton_api_snapshot.py, whose docstring says how) and must resolve in the installed
Triton. The per-step kernel arguments are checked to be unspecialized here too, since that is
read from the same decorators.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = json.loads((REPO / "tests/data/triton_api_3.6.0.json").read_text())
SCANNED = ("kernels", "engine", "bench", "tests", "scripts", "kserve_paged", "e2e")
# Attributes a kernel body takes on values (tensors, pointers, dtypes, constexprs).
VALUE_CLASSES = ["triton.language.tensor", "triton.language.dtype",
                 "triton.language.pointer_type", "triton.language.block_type",
                 "triton.language.constexpr"]
# Kernel arguments that change from step to step, by kernel: they must not be specialized
# (a value of 1 or a multiple of 16 would compile another variant in the middle of serving).
PER_STEP_ARGS = {"_paged_attn_kernel": {"num_seqs", "stride_bt", "num_splits"},
                 "_merge_splits_kernel": {"num_splits"},
                 "_gate_up_kernel": {"num_pairs"}, "_down_kernel": {"num_pairs"}}


@dataclass
class Uses:
    """Triton API uses found in source: dotted names, (callable, keyword) pairs, and value
    attributes inside jit bodies (with the methods' keywords); `where` says where each is."""

    names: set[str] = field(default_factory=set)
    keywords: set[tuple[str, str]] = field(default_factory=set)
    value_attrs: set[str] = field(default_factory=set)
    where: dict[str, str] = field(default_factory=dict)
    dont_specialize: dict[str, set[str]] = field(default_factory=dict)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to triton modules or objects by the file's imports."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "triton" or a.name.startswith("triton."):
                    out[a.asname or "triton"] = a.name if a.asname else "triton"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "triton" or node.module.startswith("triton.")):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _is_jit(fn: ast.FunctionDef, aliases: dict[str, str]) -> ast.Call | bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if _dotted(target, aliases) == "triton.jit":
            return dec if isinstance(dec, ast.Call) else True
    return False


def scan(source: str, label: str, uses: Uses | None = None) -> Uses:
    """The Triton API uses of one file's source."""
    uses = uses or Uses()
    tree = ast.parse(source)
    aliases = _aliases(tree)
    if not aliases:
        return uses
    for target in aliases.values():
        uses.names.add(target)
        uses.where.setdefault(target, label)
    jit_nodes: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and (dec := _is_jit(fn, aliases)):
            jit_nodes.update(id(n) for n in ast.walk(fn))
            if isinstance(dec, ast.Call):
                for kw in dec.keywords:
                    if kw.arg == "do_not_specialize" and isinstance(kw.value, ast.List):
                        uses.dont_specialize[fn.name] = {
                            e.value for e in kw.value.elts if isinstance(e, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None),
                                                               ast.Attribute):
            dotted = _dotted(node, aliases)
            if dotted is not None:
                uses.names.add(dotted)
                uses.where.setdefault(dotted, f"{label}:{node.lineno}")
            elif id(node) in jit_nodes:
                uses.value_attrs.add(node.attr)
                uses.where.setdefault(f"value.{node.attr}", f"{label}:{node.lineno}")
        if isinstance(node, ast.Call):
            func = _dotted(node.func, aliases)
            if func is None and id(node) in jit_nodes and isinstance(node.func, ast.Attribute):
                func = f"triton.language.tensor.{node.func.attr}"  # a method of a value
            for kw in node.keywords:
                if func is not None and kw.arg is not None:
                    uses.keywords.add((func, kw.arg))
                    uses.where.setdefault(f"{func}({kw.arg}=)", f"{label}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            child._parent = node  # type: ignore[attr-defined]
    return uses


@functools.cache
def _repo_uses() -> Uses:
    uses = Uses()
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            text = path.read_text()
            if "triton" in text:
                scan(text, str(path.relative_to(REPO)), uses)
    return uses


def missing(uses: Uses, names: dict[str, list[str]], params: dict[str, list[str]]) -> list[str]:
    """What of `uses` a Triton with these container names and parameter lists lacks."""
    problems = []
    for dotted in sorted(uses.names):
        parts = dotted.split(".")
        i = max((k for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in names), default=0)
        if i == 0:
            problems.append(f"{dotted} ({uses.where.get(dotted)}): outside the snapshot")
        elif i < len(parts) and parts[i] not in names[".".join(parts[:i])]:
            problems.append(f"{dotted} ({uses.where.get(dotted)}): no {parts[i]!r}")
    value_names = set().union(*(names[c] for c in VALUE_CLASSES))
    for attr in sorted(uses.value_attrs - value_names):
        problems.append(f"value attribute {attr!r} ({uses.where.get('value.' + attr)})")
    for func, kw in sorted(uses.keywords):
        if func in params and kw not in params[func]:
            problems.append(f"{func}({kw}=) ({uses.where.get(f'{func}({kw}=)')})")
    return problems


def test_snapshot_is_triton_3_6() -> None:
    assert SNAPSHOT["triton_version"] == "3.6.0"
    assert "load" in SNAPSHOT["names"]["triton.language"]


def test_scanner_finds_names_keywords_and_value_attributes() -> None:
    src = ("import triton\nimport triton.language as tl\n"
           "@triton.jit(do_not_specialize=['n'])\n"
           "def k(p, n, B: tl.constexpr):\n"
           "    x = tl.load(p + tl.arange(0, B), mask=None, evict='x')\n"
           "    tl.store(p, x.to(tl.float32, rounding='rtne').nope)\n")
    uses = scan(src, "t.py")
    assert {"triton.jit", "triton.language.load", "triton.language.float32"} <= uses.names
    assert ("triton.language.load", "evict") in uses.keywords
    assert "nope" in uses.value_attrs and uses.dont_specialize == {"k": {"n"}}
    problems = missing(uses, SNAPSHOT["names"], SNAPSHOT["params"])
    assert any("load(evict=)" in p for p in problems)
    assert any("tensor.to(rounding=)" in p for p in problems)
    assert any("'nope'" in p for p in problems)
    assert not any("float32" in p or "arange" in p for p in problems)


def test_our_triton_code_uses_only_what_triton_3_6_has() -> None:
    uses = _repo_uses()
    assert "triton.language.load" in uses.names and uses.value_attrs  # the scan found kernels
    assert missing(uses, SNAPSHOT["names"], SNAPSHOT["params"]) == []


def test_the_installed_triton_has_it_too() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from scripts.triton_api_snapshot import snapshot  # imports Triton: at run time only

    installed = snapshot()
    assert missing(_repo_uses(), installed["names"], installed["params"]) == []


def test_per_step_kernel_arguments_are_not_specialized() -> None:
    uses = _repo_uses()
    for kernel, args in PER_STEP_ARGS.items():
        assert args <= uses.dont_specialize.get(kernel, set()), kernel
