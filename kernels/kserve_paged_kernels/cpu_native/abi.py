"""The C ABI of the native library as ctypes sees it: one table, following `csrc/kp_native.h`.

Why one table: the functions were declared to ctypes one by one, apart from their C
prototypes, with nothing to catch a difference. `tests/kernels/test_native_abi.py` parses the
header and checks this table and the struct mirrors against it, and `loader.load()` refuses a
library whose `kp_abi_version()` is not `ABI_VERSION`. A change to the ABI changes the header,
this file and both version numbers together.
"""

from __future__ import annotations

import ctypes

ABI_VERSION = 14  # KP_ABI_VERSION in csrc/kp_native.h
QUANT_E4M3 = 9  # KP_QUANT_E4M3 in csrc/kp_native.h: `bits` of an fp8 e4m3 weight
LORA_MAX_RANK = 256  # KP_LORA_MAX_RANK in csrc/kp_native.h
# The quantized KV formats by their code dtype's name: KP_KV_INT8, KP_KV_E4M3, KP_KV_E5M2.
KV_FORMATS = {"int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}

_i32, _i64, _int, _f32, _ptr = (ctypes.c_int32, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                ctypes.c_void_p)
_ptrs = ctypes.POINTER(ctypes.c_void_p)


class DecoderStackStruct(ctypes.Structure):
    """Mirror of `kp_decoder_stack`; field order matters."""

    _fields_ = [(name, _i64) for name in (
        "layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "num_blocks",
        "block_size", "max_positions")] + [("eps", _f32), ("scale", _f32)] + [
        (name, _ptrs) for name in (
            "in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
            "down_w", "down_b", "kv")] + [
        (name, _ptr) for name in ("final_norm", "cos_table", "sin_table", "window")] + [
        (name, _ptrs) for name in ("q_norm", "k_norm")] + [
        (name, _ptr) for name in ("qbits", "qgroup")] + [("kv_scales", _ptrs), ("kv_format", _i64)] + [
        (name, _ptrs) for name in ("attn_out_norm", "mlp_out_norm", "layer_cos",
                                   "layer_sin")] + [("softcap", _f32), ("gelu", _i32)]


class DecoderStepStruct(ctypes.Structure):
    """Mirror of `kp_decoder_step`; field order matters."""

    _fields_ = [("tokens", _i64)] + [
        (name, _ptr) for name in (
            "x", "residual", "normed", "qkv", "attn", "gate_up", "act", "out", "positions",
            "slots", "block_tables")] + [("bt_stride", _i64)] + [
        (name, _ptr) for name in ("row_lens", "tok_idx", "seq_idx")] + [
        (name, _ptrs) for name in ("layer_slots", "layer_tables")] + [("layer_bt_stride", _ptr)]


# name -> (return type, argument types), in the header's order.
FUNCTIONS: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "kp_abi_version": (_int, ()),
    "kp_set_threads": (None, (_int,)),
    "kp_paged_rows_f32": (_int, (_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64,
                                 _ptr, _ptr, _ptr, _i64, _f32, _i32, _f32, _ptr, _i64)),
    "kp_paged_rows_bf16": (_int, (_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64,
                                  _ptr, _ptr, _ptr, _i64, _f32, _i32, _f32, _ptr, _i64)),
    "kp_paged_rows_sinks_f32": (_int, (_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr,
                                       _i64, _ptr, _ptr, _ptr, _i64, _f32, _i32, _f32, _ptr,
                                       _ptr, _i64)),
    "kp_paged_rows_sinks_bf16": (_int, (_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr,
                                        _i64, _ptr, _ptr, _ptr, _i64, _f32, _i32, _f32, _ptr,
                                        _ptr, _i64)),
    "kp_mxfp4_linear_f32": (_int, (_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64)),
    "kp_store_kv_q8": (_int, (_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i32, _i32,
                              _i32, _i32)),
    "kp_paged_rows_q8": (_int, (_ptr, _i64, _ptr, _ptr, _i32, _i64, _i32, _i32, _i32, _i32, _ptr,
                                _i64, _ptr, _ptr, _ptr, _i64, _f32, _i32, _f32, _ptr, _i64)),
    "kp_add_rms_norm_f32": (None, (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32)),
    "kp_qk_norm_f32": (None, (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32)),
    "kp_rope_f32": (_int, (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64)),
    "kp_silu_mul_f32": (None, (_ptr, _ptr, _i64, _i64)),
    "kp_store_kv_f32": (_int, (_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64)),
    "kp_copy_blocks": (_int, (_ptrs, _i64, _i64, _i64, _ptr, _ptr, _i64)),
    "kp_argmax_rows_f32": (None, (_ptr, _i64, _i64, _i64, _ptr)),
    "kp_add_rms_norm_bf16": (None, (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32)),
    "kp_silu_mul_bf16": (None, (_ptr, _ptr, _i64, _i64)),
    "kp_store_kv_bf16": (_int, (_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64)),
    "kp_rope_bf16": (_int, (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64)),
    "kp_add_rms_norm_gemma_bf16": (None, (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32)),
    "kp_qk_norm_gemma_bf16": (None, (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32)),
    "kp_gelu_mul_bf16": (None, (_ptr, _ptr, _i64, _i64)),
    "kp_lora_sgmv_f32": (_int, (_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64)),
    "kp_gemm_panel": (_int, ()),
    "kp_gemm_f32": (_int, (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64)),
    "kp_gemm_silu_f32": (_int, (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                                _i64)),
    "kp_gemm_gelu_f32": (_int, (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                                _i64)),
    "kp_quant_block_bytes": (_i64, (_i32, _i64)),
    "kp_quant_gemm_f32": (_int, (_ptr, _i64, _i64, _ptr, _i32, _i64, _i64, _i64, _ptr, _ptr,
                                 _i64)),
    "kp_quant_gemm_bf16": (_int, (_ptr, _i64, _i64, _ptr, _i32, _i64, _i64, _i64, _ptr, _ptr,
                                  _i64)),
    "kp_gemm_bf16": (_int, (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64)),
    "kp_decoder_stack_f32": (_int, (ctypes.POINTER(DecoderStackStruct),
                                    ctypes.POINTER(DecoderStepStruct))),
    "kp_decoder_stack_bf16": (_int, (ctypes.POINTER(DecoderStackStruct),
                                     ctypes.POINTER(DecoderStepStruct))),
}


def declare(lib: ctypes.CDLL) -> None:
    """Give each function of the table its ctypes signature; AttributeError if one is missing."""
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)
