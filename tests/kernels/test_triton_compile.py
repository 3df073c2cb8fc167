"""Compile the Triton kernels for a real GPU target (sm_90) without a GPU.

The interpreter does not catch compiled-mode errors (loop-carried type changes, constexpr
specialisation of `num_seqs == 1`, shared-memory blow-ups); Triton can lower to PTX/cubin on
a CPU-only host, so do that for a few representative specialisations.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # pragma: no cover - other Triton versions
    pytest.skip(f"Triton AOT API unavailable: {exc}", allow_module_level=True)

import kernels.triton_backend as tb  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # H100/H200 per-block maximum
ATTN_INTS = ["stride_qt", "stride_qh", "stride_ckv", "stride_cblk", "stride_coff", "stride_ch",
             "stride_bt", "stride_btc", "stride_ot", "stride_oh", "num_heads"]


def _jit(fn: object) -> JITFunction:
    """The compiled-mode kernel even when the module was imported under TRITON_INTERPRET."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)  # type: ignore[attr-defined]


def _compile(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int = 4):
    for name in consts:
        sig[name] = "constexpr"
    names = list(sig)
    src = ASTSource(fn=_jit(fn), signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        return triton.compile(src, target=TARGET, options={"num_warps": warps})
    except (FileNotFoundError, RuntimeError) as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas to finish the compile: {exc}")
        raise


@pytest.mark.parametrize(("dtype", "group", "block_m", "block_n", "block_d", "splits", "f32",
                          "one_seq"), [
    ("bf16", 4, 16, 64, 128, 8, False, True),   # decode, split-KV, num_seqs == 1 constexpr
    ("fp32", 3, 64, 32, 64, 1, True, False),    # prefill, exact fp32 dots
])
def test_attention_kernel_compiles_for_sm90(dtype: str, group: int, block_m: int, block_n: int,
                                            block_d: int, splits: int, f32: bool,
                                            one_seq: bool) -> None:
    sig = {"q_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}", "bt_ptr": "*i32",
           "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "out_ptr": f"*{dtype}",
           "part_ptr": "*fp32", "ml_ptr": "*fp32", "scale_log2e": "fp32", "num_seqs": "i32",
           "head_dim": "i32", **dict.fromkeys(ATTN_INTS, "i32")}
    consts = {"GROUP": group, "BLOCK_SIZE": 16, "BLOCK_M": block_m,
              "BLOCK_Q": max(1, block_m // group), "BLOCK_N": block_n, "BLOCK_D": block_d,
              "NUM_SPLITS": splits, "F32_DOT": f32}
    if one_seq:
        consts = {"num_seqs": 1, **consts}
    kernel = _compile(tb._paged_attn_kernel, sig, consts)
    assert kernel.metadata.shared <= SHARED_LIMIT


def test_store_and_merge_kernels_compile_for_sm90() -> None:
    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64",
           **dict.fromkeys(["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ckv",
                            "stride_cblk", "stride_coff", "stride_ch", "num_kv_heads",
                            "head_dim"], "i32")}
    _compile(tb._store_kv_kernel, sig, {"BLOCK_SIZE": 16, "BLOCK_H": 1, "BLOCK_D": 128})
    sig = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "num_heads": "i32",
           "head_dim": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    _compile(tb._merge_splits_kernel, sig, {"NUM_SPLITS": 5, "SPLITS_P2": 8, "BLOCK_D": 128})
