"""Small C kernels for CPU serving, built with the system C compiler.

Why: on CPU the PyTorch path copies every decode row's blocks into a contiguous tensor and
reads that copy again in SDPA; decode is bound by that memory traffic. `csrc/paged_decode.c`
reads each K/V row once, for all query heads of its group. `csrc/cpu_ops.c` fuses a layer's
elementwise work (residual add + RMSNorm, RoPE in place, SiLU-and-multiply) into one pass each.
`csrc/gemm.c` is the fp32 matrix product of the linear layers (AVX-512 only), over weights
packed once into column panels. `csrc/decoder_stack.c` runs a whole stack of decoder layers out
of those kernels in one call (`DecoderStack`), so a step pays no per-layer Python.
It is plain C called through ctypes (no PyTorch headers), so building it takes a couple of
seconds; the library is cached under
`$KSERVE_PAGED_CACHE/native` (else `~/.cache/kserve-paged/native`) keyed by the source's hash.
If no compiler is found or the build fails, `load()` returns None (the reason is logged once)
and the PyTorch path serves. `KSERVE_PAGED_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels import settings

logger = logging.getLogger("kernels")

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "paged_decode.c", _CSRC / "cpu_ops.c", _CSRC / "gemm.c",
           _CSRC / "decoder_stack.c")
HEADERS = (_CSRC / "simd_exp.h",)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = settings.cache_dir() / "native" / f"kp_native-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: a half-written library is never loaded
    return target


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not settings.native_enabled():
        logger.info("native CPU kernels disabled by KSERVE_PAGED_NATIVE")
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None
    fn = lib.kp_paged_rows_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_int64]
    lib.kp_set_threads.argtypes = [ctypes.c_int]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kp_add_rms_norm_f32.restype = None
    lib.kp_add_rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.kp_rope_f32.restype = ctypes.c_int
    lib.kp_rope_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.kp_silu_mul_f32.restype = None
    lib.kp_silu_mul_f32.argtypes = [ptr, ptr, i64, i64]
    lib.kp_store_kv_f32.restype = ctypes.c_int
    lib.kp_store_kv_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64]
    lib.kp_gemm_available.restype = ctypes.c_int
    lib.kp_gemm_available.argtypes = []
    lib.kp_gemm_f32.restype = ctypes.c_int
    lib.kp_gemm_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64]
    lib.kp_gemm_silu_f32.restype = ctypes.c_int
    lib.kp_gemm_silu_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64]
    lib.kp_argmax_rows_f32.restype = None
    lib.kp_argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.kp_decoder_stack_f32.restype = ctypes.c_int
    lib.kp_decoder_stack_f32.argtypes = [ctypes.POINTER(_StackStruct),
                                         ctypes.POINTER(_StepStruct)]
    _lib = lib
    logger.info("native CPU kernels loaded")
    return _lib


def usable(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp32 CPU tensors in the contract's contiguous layout, within the kernel's limits."""
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu"
            and query.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and query.stride(2) == 1 and query.stride(1) == head_dim
            and heads // kv_heads <= 32 and head_dim <= 256 and block_size <= 256
            and load() is not None)


def paged_rows(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               row_lens: torch.Tensor, token_idx: torch.Tensor, seq_idx: torch.Tensor,
               scale: float, out: torch.Tensor) -> None:
    """Write attention of query rows `token_idx` into the same rows of `out`
    (`[num_tokens, num_heads, head_dim]`, heads contiguous in a row). Row r belongs to the
    sequence whose block-table row is `seq_idx[r]` and attends to its first `row_lens[r]` keys:
    the whole context for a decode token, `position + 1` keys for a prefill token (causality)."""
    lib = load()
    assert lib is not None
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = row_lens if row_lens.dtype == torch.int32 else row_lens.int()
    bt, lens = bt.contiguous(), lens.contiguous()
    tok = token_idx.long().contiguous()
    seq = seq_idx.long().contiguous()
    if not (tok.numel() == seq.numel() == lens.numel()):
        raise ValueError("token_idx, seq_idx and row_lens must have one entry per row")
    _sync_threads(lib)
    rc = lib.kp_paged_rows_f32(
        query.data_ptr(), query.stride(0), kv_cache.data_ptr(), kv_cache.shape[1],
        kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4], query.shape[1],
        bt.data_ptr(), bt.stride(0), lens.data_ptr(), tok.data_ptr(), seq.data_ptr(),
        tok.numel(), float(scale), out.data_ptr(), out.stride(0))
    if rc == -2:
        raise MemoryError("native paged attention could not allocate its scratch")
    if rc != 0:
        raise ValueError("native paged attention: shape outside the kernel's limits")


def _f32_rows(t: torch.Tensor) -> bool:
    """fp32 CPU rows with unit stride inside a row (the C kernels' layout)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and (
        t.stride(1) == 1 or t.shape[1] == 1)


_thread_state = threading.local()  # OpenMP's thread count is a per-thread setting


def _sync_threads(lib: ctypes.CDLL) -> None:
    """Give the library's OpenMP regions torch's thread count (a ctypes call only on change)."""
    n = torch.get_num_threads()
    if getattr(_thread_state, "threads", 0) != n:
        lib.kp_set_threads(n)
        _thread_state.threads = n


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """`weight * rmsnorm(x (+ residual))` in one pass, `residual` updated in place to the sum;
    None (nothing done) when the tensors are not in the kernel's layout."""
    lib = load()
    if (lib is None or not _f32_rows(x) or not weight.is_contiguous()
            or weight.dtype != torch.float32 or x.shape[1] != weight.shape[0]
            or (residual is not None and (not residual.is_contiguous()
                                          or residual.dtype != torch.float32
                                          or residual.shape != x.shape))):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    _sync_threads(lib)
    lib.kp_add_rms_norm_f32(x.data_ptr(), x.stride(0),
                            residual.data_ptr() if residual is not None else None,
                            weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: int, head_dim: int) -> bool:
    """Rotate the first `heads` heads of each row of `x` in place; False when not applicable."""
    lib = load()
    if (lib is None or not _f32_rows(x) or x.shape[1] < heads * head_dim or head_dim % 2
            or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape[-1] * 2 != head_dim or positions.numel() != x.shape[0]):
        return False
    _sync_threads(lib)
    rc = lib.kp_rope_f32(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), cos.shape[0], x.shape[0], heads, head_dim)
    if rc != 0:
        raise IndexError(f"a position is outside the rotary table of {cos.shape[0]} positions")
    return True


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copy rows of key/value (`[tokens, kv_heads, head_dim]`, each row contiguous) into their
    slots of the fp32 paged cache (slots < 0 skipped); False (nothing done) when the tensors are
    not in that layout, IndexError for a slot past the cache."""
    lib = load()
    if (lib is None or kv_cache.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous() or key.dim() != 3 or value.shape != key.shape
            or key.shape[1:] != kv_cache.shape[3:]):
        return False
    row = key.shape[1] * key.shape[2]
    if (key.stride(2) != 1 or key.stride(1) != key.shape[2] or value.stride(2) != 1
            or value.stride(1) != value.shape[2] or slot_mapping.numel() != key.shape[0]):
        return False
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    rc = lib.kp_store_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                             slot_mapping.data_ptr(), key.shape[0], kv_cache.data_ptr(),
                             num_slots, row)
    if rc != 0:
        raise IndexError(f"a KV slot is outside the cache of {num_slots} slots")
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` for a fused `[rows, 2 * inter]` projection; None when not applicable."""
    lib = load()
    if lib is None or not _f32_rows(gate_up) or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    _sync_threads(lib)
    lib.kp_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out


def _gate_up_pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows of gate and up, each zero-padded to whole panels, interleaved panel by panel."""
    rest = gate.shape[1:]
    pairs = -(-gate.shape[0] // GEMM_PANEL)
    pad = torch.zeros((pairs * GEMM_PANEL - gate.shape[0], *rest), dtype=torch.float32)
    halves = [torch.cat([h.detach().float(), pad]).view(pairs, GEMM_PANEL, *rest)
              for h in (gate, up)]
    return torch.stack(halves, dim=1).reshape(pairs * 2 * GEMM_PANEL, *rest)


def pack_gate_up_weight(weight: torch.Tensor) -> torch.Tensor:
    """A fused `[2 * inter, K]` gate/up weight -> panels for `gemm_silu`: gate and up outputs
    48 at a time, pair by pair (each half zero-padded to whole panels)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % 2:
        raise ValueError("pack_gate_up_weight takes a 2-D float32 [2 * inter, K] weight")
    inter = weight.shape[0] // 2
    return pack_gemm_weight(_gate_up_pairs(weight[:inter], weight[inter:]))


def pack_gate_up_bias(bias: torch.Tensor) -> torch.Tensor:
    """The fused gate/up bias in the order of `pack_gate_up_weight`'s outputs."""
    if bias.dim() != 1 or bias.shape[0] % 2:
        raise ValueError("pack_gate_up_bias takes a [2 * inter] bias")
    inter = bias.shape[0] // 2
    return _gate_up_pairs(bias[:inter], bias[inter:])


def gemm_silu(x: torch.Tensor, packed: torch.Tensor, inter: int,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`silu(x @ gate.T + bg) * (x @ up.T + bu)` `[rows, inter]` with a weight (and bias) from
    `pack_gate_up_weight` / `pack_gate_up_bias`; None when `x` is not in the kernel's layout.
    (A plain `pack_gemm_weight` of the fused weight has the same shape when inter is a multiple
    of 48, but not the pair order: only pass what `pack_gate_up_weight` made.)"""
    lib = load()
    pairs = -(-inter // GEMM_PANEL)
    if (lib is None or not _f32_rows(x) or packed.dim() != 3 or x.shape[1] != packed.shape[1]
            or packed.shape[0] != 2 * pairs or packed.shape[2] != GEMM_PANEL
            or packed.dtype != torch.float32 or not packed.is_contiguous()
            or packed.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                      or bias.numel() != 2 * pairs * GEMM_PANEL))):
        return None
    rows = x.shape[0]
    scratch = torch.empty((rows, 2 * pairs * GEMM_PANEL), dtype=torch.float32)
    out = torch.empty((rows, inter), dtype=torch.float32)
    _sync_threads(lib)
    rc = lib.kp_gemm_silu_f32(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), x.shape[1],
                              inter, bias.data_ptr() if bias is not None else None,
                              scratch.data_ptr(), scratch.stride(0), out.data_ptr(), inter)
    return out if rc == 0 else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(-1)` (int64) for fp32 CPU rows, same tie and NaN rules; None when `x` is not
    in the kernel's layout, so the caller uses torch."""
    lib = load()
    if lib is None or not _f32_rows(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _sync_threads(lib)
    lib.kp_argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


GEMM_PANEL = 48  # output columns per packed panel (NR in csrc/gemm.c)


def gemm_available() -> bool:
    """True when the library is loaded and was built with AVX-512 (the GEMM's only version)."""
    lib = load()
    return lib is not None and bool(lib.kp_gemm_available())


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` fp32 weight -> `[ceil(N / 48), K, 48]` column panels, zero-padded past N."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError("pack_gemm_weight takes a 2-D float32 weight")
    n, k = weight.shape
    panels = -(-n // GEMM_PANEL)
    padded = torch.zeros((panels * GEMM_PANEL, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, GEMM_PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
         bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T (+ bias)` with a weight from `pack_gemm_weight`; None when `x` or `bias`
    is not in the kernel's layout (fp32, rows with unit stride), so the caller falls back."""
    lib = load()
    if (lib is None or not _f32_rows(x) or x.shape[1] != packed.shape[1]
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    _sync_threads(lib)
    rc = lib.kp_gemm_f32(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), x.shape[1],
                         out_features, bias.data_ptr() if bias is not None else None,
                         out.data_ptr(), out_features)
    if rc != 0:
        return None
    return out


_ptrs = ctypes.POINTER(ctypes.c_void_p)


class _StackStruct(ctypes.Structure):
    """Mirror of `kp_decoder_stack` (csrc/decoder_stack.c); field order matters."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "num_blocks",
        "block_size", "max_positions")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, _ptrs) for name in (
            "in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
            "down_w", "down_b", "kv")] + [
        (name, ctypes.c_void_p) for name in ("final_norm", "cos_table", "sin_table")]


class _StepStruct(ctypes.Structure):
    """Mirror of `kp_decoder_step` (csrc/decoder_stack.c)."""

    _fields_ = [("tokens", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in (
            "x", "residual", "normed", "qkv", "attn", "gate_up", "act", "out", "positions",
            "slots", "block_tables")] + [("bt_stride", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("row_lens", "tok_idx", "seq_idx")]


_STACK_ERRORS = {
    -1: (IndexError, "a position is outside the rotary table"),
    -2: (IndexError, "a KV slot is outside the cache"),
    -3: (ValueError, "native paged attention: shape outside the kernel's limits"),
    -4: (RuntimeError, "the native GEMM refused its arguments"),
    -5: (MemoryError, "native paged attention could not allocate its scratch"),
}


def _f32_vector(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                         and t.is_contiguous() and t.numel() == n)


class DecoderStack:
    """A Llama-family decoder stack's weights, laid out for `kp_decoder_stack_f32`.

    `layers` holds, per layer, the packed weights (`pack_gemm_weight`; gate/up from
    `pack_gate_up_weight`, its bias from `pack_gate_up_bias`) and optional biases of
    qkv / o / gate_up / down and the two norm weights; the tensors are kept referenced here so
    the pointers stay valid. `run` takes one step's embeddings and metadata and returns the
    final normed hidden state, the same values the per-layer modules compute. Its activation
    scratch is reused from step to step, so one stack serves one step at a time (as the engine
    runs them).
    """

    _KEYS = ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
             "down_w", "down_b")

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], final_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, hidden: int, heads: int,
                 kv_heads: int, head_dim: int, inter: int, eps: float, scale: float) -> None:
        q, kv = heads * head_dim, kv_heads * head_dim
        padded = 2 * -(-inter // GEMM_PANEL) * GEMM_PANEL  # gate/up as panel pairs
        shapes = {"in_norm": hidden, "post_norm": hidden, "qkv_b": q + 2 * kv, "o_b": hidden,
                  "gate_up_b": padded, "down_b": hidden}
        panels = {"qkv_w": (q + 2 * kv, hidden), "o_w": (hidden, q), "gate_up_w": (padded, hidden),
                  "down_w": (hidden, inter)}
        for i, layer in enumerate(layers):
            for key, n in shapes.items():
                if not _f32_vector(layer.get(key), n):
                    raise ValueError(f"layer {i}: {key} is not a contiguous fp32 CPU vector of {n}")
            for key, (n, k) in panels.items():
                w = layer[key]
                if (w is None or w.dtype != torch.float32 or not w.is_contiguous()
                        or tuple(w.shape) != (-(-n // GEMM_PANEL), k, GEMM_PANEL)):
                    raise ValueError(f"layer {i}: {key} is not a packed [{n}, {k}] weight")
        if not _f32_vector(final_norm, hidden):
            raise ValueError("final_norm is not a contiguous fp32 CPU vector")
        if (cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.shape != sin.shape
                or cos.shape[-1] * 2 != head_dim):
            raise ValueError("the rotary tables must be contiguous fp32 [positions, head_dim / 2]")
        if heads % kv_heads or heads // kv_heads > 32 or head_dim > 256 or head_dim % 2:
            raise ValueError("head layout outside the native attention kernel's limits")
        if not gemm_available():
            raise ValueError("the native GEMM is not available (needs AVX-512 and a compiler)")
        self._keep = (layers, final_norm, cos, sin)
        self.num_layers = len(layers)
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.inter = inter
        self._arrays = {key: (ctypes.c_void_p * len(layers))(
            *[(layer[key].data_ptr() if layer.get(key) is not None else None) for layer in layers])
            for key in self._KEYS}
        self._struct = _StackStruct(
            layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, inter=inter, max_positions=cos.shape[0], eps=eps, scale=scale,
            final_norm=final_norm.data_ptr(), cos_table=cos.data_ptr(), sin_table=sin.data_ptr(),
            **{key: ctypes.cast(arr, _ptrs) for key, arr in self._arrays.items()})
        self._kv_key: tuple | None = None
        self._scratch = torch.empty(0, dtype=torch.float32)

    def _bind_kv(self, kv_caches: list[torch.Tensor]) -> None:
        # Addresses and shapes: a new cache at a freed cache's address must be checked again.
        key = tuple((c.data_ptr(), tuple(c.shape), c.dtype) for c in kv_caches)
        if key == self._kv_key:
            return
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        shape = kv_caches[0].shape
        for c in kv_caches:
            if (c.device.type != "cpu" or c.dtype != torch.float32 or not c.is_contiguous()
                    or c.dim() != 5 or c.shape != shape or c.shape[0] != 2
                    or tuple(c.shape[3:]) != (self.kv_heads, self.head_dim)
                    or c.shape[2] > 256):
                raise ValueError("KV caches must be contiguous fp32 CPU tensors "
                                 "[2, blocks, block_size <= 256, kv_heads, head_dim]")
        self._kv_array = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
        self._struct.kv = ctypes.cast(self._kv_array, _ptrs)
        self._struct.num_blocks, self._struct.block_size = shape[1], shape[2]
        self._kv_key = key

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            kv_caches: list[torch.Tensor], block_tables: torch.Tensor, row_lens: torch.Tensor,
            seq_idx: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden]` embeddings (overwritten as scratch) -> final hidden `[T, hidden]`.

        positions/slots int64 `[T]`; token t is an attention row over the first row_lens[t]
        (int32) keys of block-table row seq_idx[t] (int64) of `block_tables` (int32)."""
        lib = load()
        assert lib is not None
        t = x.shape[0]
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.hidden):
            raise ValueError("x must be contiguous fp32 [tokens, hidden]")
        # The per-layer path takes other integer widths and strides too: convert, do not refuse.
        positions, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        row_lens, seq_idx = row_lens.to(torch.int32).contiguous(), seq_idx.to(torch.int64).contiguous()
        block_tables = block_tables.to(torch.int32).contiguous()
        for name, v in (("positions", positions), ("slots", slots), ("row_lens", row_lens),
                        ("seq_idx", seq_idx)):
            if v.dim() != 1 or v.numel() != t or v.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU vector with one entry per token")
        if block_tables.dim() != 2:
            raise ValueError("block_tables must be [seqs, blocks]")
        self._bind_kv(kv_caches)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # Each activation gets its own contiguous [T, n] block of one allocation.
        sizes = {"residual": self.hidden, "normed": self.hidden, "qkv": q + 2 * kv, "attn": q,
                 "gate_up": 2 * -(-self.inter // GEMM_PANEL) * GEMM_PANEL, "act": self.inter}
        need = t * sum(sizes.values())
        if self._scratch.numel() < need:
            # Kept between steps: a fresh 60 MB buffer per 2048-token step was ~15,000 page
            # faults each (W1 spent 0.5 s of system time in them).
            self._scratch = torch.empty(need, dtype=torch.float32)
        scratch = self._scratch
        out = torch.empty((t, self.hidden), dtype=torch.float32)
        ptrs, base = {}, scratch.data_ptr()
        for name, n in sizes.items():
            ptrs[name] = base
            base += t * n * scratch.element_size()
        tok_idx = torch.arange(t, dtype=torch.int64)
        step = _StepStruct(
            tokens=t, x=x.data_ptr(), out=out.data_ptr(), positions=positions.data_ptr(),
            slots=slots.data_ptr(), block_tables=block_tables.data_ptr(),
            bt_stride=block_tables.stride(0), row_lens=row_lens.data_ptr(),
            tok_idx=tok_idx.data_ptr(), seq_idx=seq_idx.data_ptr(), **ptrs)
        _sync_threads(lib)
        rc = lib.kp_decoder_stack_f32(ctypes.byref(self._struct), ctypes.byref(step))
        if rc != 0:
            exc, msg = _STACK_ERRORS.get(rc, (RuntimeError, f"decoder stack failed ({rc})"))
            raise exc(msg)
        return out
