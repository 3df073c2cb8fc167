"""Child process of test_triton_compile: compiles one Triton kernel for sm_90 and prints JSON.

Why a separate process: once a pytest process has run a kernel in Triton's interpreter
(test_triton_backend sets TRITON_INTERPRET=1 at collection), the interpreter's patches to
`triton.language` stay in place and a later real compile fails inside them. A warm Triton cache
hid that (the compile was never redone); a child with a clean interpreter state and its own
empty cache compiles for real every time.

Usage: python -m tests.kernels.sm90_compile CASE  (CASE: a key of ATTENTION_CASES, store-merge,
lora-sgmv, fused-moe, fused-ops or quant-gemm)
Prints {"shared": [bytes, ...]} or {"skip": reason}.
"""

from __future__ import annotations

import json
import sys

TARGET_ARCH = 90
ATTN_INTS = ["stride_qt", "stride_qh", "stride_ckv", "stride_cblk", "stride_coff", "stride_ch",
             "stride_bt", "stride_btc", "stride_ot", "stride_oh", "num_heads", "stride_skv",
             "stride_sblk"]
ATTENTION_CASES = {  # dtype, group, BLOCK_M, BLOCK_N, BLOCK_D, splits, f32, one seq, window, cap
    # decode, split-KV, num_seqs == 1 constexpr
    "attention-bf16": ("bf16", 4, 16, 64, 128, 8, False, True, False, False),
    # prefill, exact fp32 dots
    "attention-fp32": ("fp32", 3, 64, 32, 64, 1, True, False, False, False),
    # Gemma: sliding window and soft-capping, prefill and split decode
    "attention-bf16-window-softcap": ("bf16", 4, 64, 64, 256, 1, False, False, True, True),
    "attention-bf16-window-split": ("bf16", 4, 16, 64, 256, 4, False, False, True, False),
    # encoders (issue 35): bidirectional prefill, no causal mask (CAUSAL False)
    "attention-fp32-bidirectional": ("fp32", 3, 64, 32, 64, 1, True, False, False, False),
    # a quantized KV cache (kernels/kserve_paged_kernels/kv_quant.py): int8 codes under split decode, fp8 in prefill
    "attention-bf16-int8kv": ("bf16", 4, 16, 64, 128, 8, False, False, False, False),
    "attention-bf16-fp8kv": ("bf16", 4, 64, 64, 128, 1, False, False, True, False),
}
KV_CODES = {"attention-bf16-int8kv": "i8", "attention-bf16-fp8kv": "fp8e4nv"}
CASES = (*ATTENTION_CASES, "store-merge", "lora-sgmv", "fused-moe", "fused-ops", "quant-gemm")


class Skip(Exception):
    """This host cannot finish the compile (no ptxas, no AOT API): not a kernel defect."""


def _compile(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in consts:
        sig[name] = "constexpr"
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        return triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32),
                              options={"num_warps": warps})
    except (FileNotFoundError, RuntimeError) as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():
            raise Skip(f"no ptxas to finish the compile: {exc}") from exc
        raise


def _attention(case: str) -> list[int]:
    import kserve_paged_kernels.triton_backend as tb

    (dtype, group, block_m, block_n, block_d, splits, f32, one_seq, window,
     softcap) = ATTENTION_CASES[case]
    codes = KV_CODES.get(case)
    sig = {"q_ptr": f"*{dtype}", "cache_ptr": f"*{codes or dtype}", "bt_ptr": "*i32",
           "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "out_ptr": f"*{dtype}",
           "part_ptr": "*fp32", "ml_ptr": "*fp32", "kvs_ptr": "*fp32", "sinks_ptr": "*fp32",
           "scale_log2e": "fp32",
           "num_seqs": "i32", "num_splits": "i32",
           "head_dim": "i32", "window": "i32", "softcap": "fp32",
           **dict.fromkeys(ATTN_INTS, "i32")}
    consts: dict[str, object] = {
        "GROUP": group, "BLOCK_SIZE": 16, "BLOCK_M": block_m, "BLOCK_Q": max(1, block_m // group),
        "BLOCK_N": block_n, "BLOCK_D": block_d, "SPLIT": splits > 1, "F32_DOT": f32,
        "USE_WINDOW": window, "USE_SOFTCAP": softcap,
        "CAUSAL": not case.endswith("-bidirectional"), "KV_QUANT": codes is not None,
        "USE_SINKS": False}
    if one_seq:
        consts = {"num_seqs": 1, **consts}
    return [_compile(tb._paged_attn_kernel, sig, consts).metadata.shared]


def _store_merge() -> list[int]:
    import triton

    import kserve_paged_kernels.triton_backend as tb

    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64",
           **dict.fromkeys(["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ckv",
                            "stride_cblk", "stride_coff", "stride_ch", "num_kv_heads",
                            "head_dim"], "i32")}
    store = _compile(tb._store_kv_kernel, sig, {"BLOCK_SIZE": 16, "BLOCK_H": 1, "BLOCK_D": 128})
    sig = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "sinks_ptr": "*fp32",
           "num_heads": "i32",
           "head_dim": "i32", "stride_ot": "i32", "stride_oh": "i32", "num_splits": "i32"}
    merge = _compile(tb._merge_splits_kernel, sig,
                     {"SPLITS_P2": triton.next_power_of_2(tb.MAX_SPLITS), "BLOCK_D": 128,
                      "USE_SINKS": False})
    import kserve_paged_kernels.kv_quant_triton as kqt

    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "code_ptr": "*u8", "scale_ptr": "*fp32",
           "slot_ptr": "*i64", **dict.fromkeys(
               ["num_tokens", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ckv",
                "stride_cblk", "stride_coff", "stride_ch", "stride_skv", "num_kv_heads",
                "head_dim"], "i32")}
    quant = [_compile(kqt._store_quant_kernel, dict(sig),  # int8 and fp8_e4m3 codes
                      {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128, "FMT": fmt, "QMAX": qmax})
             for fmt, qmax in ((0, 127.0), (1, 448.0))]
    import kserve_paged_kernels.block_copy_triton as bct

    sig = {"cache_ptr": "*bf16", "src_ptr": "*i64", "dst_ptr": "*i64", "half_elems": "i64",
           "block_elems": "i32"}
    copy = _compile(bct._copy_blocks_kernel, sig, {"BLOCK": 4096})
    return [store.metadata.shared, merge.metadata.shared, copy.metadata.shared,
            *(q.metadata.shared for q in quant)]


def _lora_sgmv() -> list[int]:
    import kserve_paged_kernels.lora_triton as lt

    seg = {"rows_ptr": "*i64", "seg_start_ptr": "*i64", "seg_len_ptr": "*i64",
           "seg_slot_ptr": "*i64"}
    sig = {"x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*fp32", **seg,
           **dict.fromkeys(["in_features", "rank", "stride_xt", "stride_as", "stride_ar",
                            "stride_yt"], "i32")}
    shrink = _compile(lt._shrink_kernel, sig, {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_R": 16})
    sig = {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", **seg, "scales_ptr": "*fp32",
           **dict.fromkeys(["out_features", "rank", "stride_yt", "stride_bs", "stride_bo",
                            "stride_ot"], "i32")}
    expand = _compile(lt._expand_kernel, sig, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16})
    return [shrink.metadata.shared, expand.metadata.shared]


def _fused_moe() -> list[int]:
    import kserve_paged_kernels.moe_triton as mt

    route = {"sorted_ptr": "*i64", "block_expert_ptr": "*i32", "num_pairs": "i32"}
    consts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "F32_DOT": False}
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "act_ptr": "*fp32", **route, "top_k": "i32",
           **dict.fromkeys(["hidden", "inter", "stride_xt", "stride_we", "stride_wn",
                            "stride_at"], "i32")}
    gate_up = _compile(mt._gate_up_kernel, sig, dict(consts))
    sig = {"act_ptr": "*fp32", "w_ptr": "*bf16", "weights_ptr": "*fp32", "out_ptr": "*fp32",
           **route, **dict.fromkeys(["hidden", "inter", "stride_at", "stride_we", "stride_wn",
                                     "stride_ot"], "i32")}
    down = _compile(mt._down_kernel, sig, dict(consts))
    return [gate_up.metadata.shared, down.metadata.shared]


def _fused_ops() -> list[int]:
    """The layer's fused elementwise kernels at Llama-3-8B's shape (hidden 4096, 32 + 8 heads
    of 128, block 16), bf16, with every flag of each, plus fp32 rows (the exact-dtype path)."""
    import kserve_paged_kernels.act_triton as at
    import kserve_paged_kernels.norm_triton as nt
    import kserve_paged_kernels.rope_triton as rt

    shared = []
    for dtype, gemma, residual in (("bf16", False, True), ("bf16", True, True),
                                   ("fp32", False, False)):
        sig = {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
               "out_ptr": f"*{dtype}", **dict.fromkeys(["stride_x", "stride_r", "stride_o",
                                                        "hidden"], "i32"), "eps": "fp32"}
        shared.append(_compile(nt._add_rms_norm_kernel, sig, {
            "HAS_RESIDUAL": residual, "GEMMA": gemma, "BLOCK": 4096}, warps=8).metadata.shared)
    for store in (True, False):
        sig = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
               "cache_ptr": "*bf16", "slot_ptr": "*i64",
               **dict.fromkeys(["stride_t", "stride_cos", "stride_ckv", "stride_cblk",
                                "stride_coff", "stride_ch", "num_heads", "num_kv_heads"], "i32")}
        shared.append(_compile(rt._rope_store_kernel, sig, {
            "HEAD_DIM": 128, "HALF_P2": 64, "BLOCK_H": 64, "BLOCK_KV": 8, "BLOCK_D": 128,
            "BLOCK_SIZE": 16, "STORE": store}, warps=8).metadata.shared)
    for gelu in (False, True):
        sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32",
               "inter": "i32"}
        shared.append(_compile(at._act_mul_kernel, sig, {"GELU": gelu, "BLOCK": 1024})
                      .metadata.shared)
    return shared


def _quant_gemm() -> list[int]:
    """The AWQ and GPTQ int4 GEMMs and the fp8 GEMM (per tensor, per channel and [128, 128]
    blocks), bf16 activations, tensor-core dots."""
    import kserve_paged_kernels.quant_gemm_triton as qg

    tiles = {"F32_DOT": False, "BLOCK_M": qg.BLOCK_M, "BLOCK_N": qg.BLOCK_N,
             "BLOCK_K": qg.BLOCK_K}
    shared = []
    for awq in (True, False):
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16",
               "g_ptr": "*i32", "out_ptr": "*bf16",
               **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_qw", "stride_qz", "stride_s",
                                "stride_om", "zero_offset"], "i32")}
        shared.append(_compile(qg._int4_gemm_kernel, sig, {"AWQ": awq, **tiles}).metadata.shared)
    for per_channel, block in ((True, 0), (False, 0), (False, 128)):
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16",
               **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                "stride_s"], "i32")}
        shared.append(_compile(qg._fp8_gemm_kernel, sig, {
            "PER_CHANNEL": per_channel, "SCALE_BN": max(block, 1), "SCALE_BK": block, **tiles})
            .metadata.shared)
    return shared


def main(case: str) -> dict[str, object]:
    try:
        import triton.backends.compiler  # noqa: F401
        import triton.compiler  # noqa: F401
    except ImportError as exc:
        return {"skip": f"Triton AOT API unavailable: {exc}"}
    try:
        shared = (_store_merge() if case == "store-merge" else _lora_sgmv()
                  if case == "lora-sgmv" else _fused_moe() if case == "fused-moe"
                  else _fused_ops() if case == "fused-ops"
                  else _quant_gemm() if case == "quant-gemm" else _attention(case))
    except Skip as exc:
        return {"skip": str(exc)}
    return {"shared": shared}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python -m tests.kernels.sm90_compile {{{','.join(CASES)}}}")
    print(json.dumps(main(sys.argv[1])))
