"""The Triton kernels whose tests compare bit for bit with torch ask the GPU for torch's
arithmetic (issue 48, item 4).

On CUDA, Triton lowers a float32 `/` to an approximate division (`div.full.f32`, up to two
units in the last place off) and contracts a multiply feeding an add into one FMA (one rounding
where torch rounds twice); torch's CUDA kernels divide exactly (IEEE, round to nearest) and
round each product. Triton's interpreter on CPU computes in numpy and does neither, so the
bit-exact tests (tests/kernels/test_kv_quant_triton.py, the RoPE check of
tests/kernels/test_fused_triton.py) pass here whatever the kernel asks for. What keeps them
bit-exact on a GPU too is checked on the kernels' source: in these modules no `@triton.jit`
function divides with `/` (`tl.math.div_rn` is the IEEE division), and every launch passes
`enable_fp_fusion=False`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "kserve_paged_kernels"
BIT_EXACT = ["kv_quant_triton.py", "rope_triton.py"]


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def jitted(fn: ast.FunctionDef) -> bool:
        return any("jit" in ast.unparse(d) for d in fn.decorator_list)

    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and jitted(n)]


def _launches(tree: ast.Module, kernels: set[str]) -> list[ast.Call]:
    """Calls `kernel[grid](...)` of a jit function of the module."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)
            and n.func.value.id in kernels]


@pytest.mark.parametrize("module", BIT_EXACT)
def test_bit_exact_kernels_divide_as_ieee(module: str) -> None:
    tree = ast.parse((KERNELS / module).read_text())
    found = [f"{fn.name}:{n.lineno} {ast.unparse(n)}" for fn in _jit_functions(tree)
             for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
    assert found == [], "an approximate division on CUDA: use tl.math.div_rn"


@pytest.mark.parametrize("module", BIT_EXACT)
def test_bit_exact_kernels_launch_without_fma_contraction(module: str) -> None:
    tree = ast.parse((KERNELS / module).read_text())
    kernels = {fn.name for fn in _jit_functions(tree)}
    launches = _launches(tree, kernels)
    assert launches, f"no launch found in {module}"
    for call in launches:
        flags = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert flags.get("enable_fp_fusion") == "False", (
            f"{module}:{call.lineno} launches {ast.unparse(call.func)} with FMA contraction")


def test_the_source_checks_see_a_division_and_a_launch() -> None:
    """The checks find what they look for: a `/` in a jit function and a plain launch."""
    src = ("@triton.jit\ndef k(x_ptr):\n    y = 1.0 / x_ptr\n\n"
           "def launch(x):\n    k[(1,)](x, num_warps=4)\n")
    tree = ast.parse(src)
    (fn,) = _jit_functions(tree)
    assert any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for n in ast.walk(fn))
    (call,) = _launches(tree, {"k"})
    assert "enable_fp_fusion" not in {k.arg for k in call.keywords}
