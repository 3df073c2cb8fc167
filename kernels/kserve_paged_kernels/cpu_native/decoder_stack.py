"""A whole decoder stack in one native call (`csrc/decoder_stack.c`): no per-layer Python."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kserve_paged_kernels.cpu_native import abi
from kserve_paged_kernels.cpu_native.gemm import gemm_available
from kserve_paged_kernels.cpu_native.kvq import kv_format
from kserve_paged_kernels.cpu_native.loader import gemm_panel, loaded, sync_threads

_ptrs = ctypes.POINTER(ctypes.c_void_p)

_STACK_ERRORS = {
    -1: (IndexError, "a position is outside the rotary table"),
    -2: (IndexError, "a KV slot is outside the cache"),
    -3: (ValueError, "native paged attention: shape outside the kernel's limits"),
    -4: (RuntimeError, "the native GEMM refused its arguments"),
    -5: (MemoryError, "native paged attention could not allocate its scratch"),
}


_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _f32_vector(t: torch.Tensor | None, n: int, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == dtype
                         and t.is_contiguous() and t.numel() == n)


def _packed_ok(w: torch.Tensor | None, n: int, k: int, panel: int, dtype: torch.dtype) -> bool:
    """fp32: `pack_gemm_weight`'s [panels, k, panel]; bf16: `pack_gemm_weight_bf16`'s int32
    [panels, k / 2, panel]."""
    if w is None or not w.is_contiguous():
        return False
    if dtype == torch.float32:
        return w.dtype == torch.float32 and tuple(w.shape) == (-(-n // panel), k, panel)
    return w.dtype == torch.int32 and tuple(w.shape) == (-(-n // panel), k // 2, panel)


def _quant_ok(w: torch.Tensor | None, bits: int, group: int, n: int, k: int, panel: int) -> bool:
    """A `pack_q4`/`pack_q8` weight of `[n, k]` in groups of `group`."""
    blk = int(loaded().kp_quant_block_bytes(bits, group)) if group > 0 else -1
    return (w is not None and blk > 0 and k % group == 0 and w.dtype == torch.uint8
            and w.is_contiguous() and w.device.type == "cpu"
            and w.numel() == -(-n // panel) * (k // group) * blk)


def _check_layers(layers: list[dict], dims: tuple[int, int, int, int], panel: int,
                  dtype: torch.dtype, head_dim: int) -> list[bool]:
    """ValueError naming the first weight not in the stack's layout (a layer's `formats`:
    int4/int8 projections); each layer's q/k norm."""
    hidden, qkv, q, inter = dims
    for i, layer in enumerate(layers):
        fmt = layer.get("formats") or {}
        # fp32: gate/up as panel pairs (gemm_silu) unless quantized; bf16: plain
        plain = dtype != torch.float32 or "gate_up_w" in fmt
        padded = 2 * inter if plain else 2 * -(-inter // panel) * panel
        shapes = {"in_norm": hidden, "post_norm": hidden, "qkv_b": qkv, "o_b": hidden,
                  "gate_up_b": padded, "down_b": hidden, "attn_out_norm": hidden,
                  "mlp_out_norm": hidden}
        for key, n in shapes.items():
            if not _f32_vector(layer.get(key), n, dtype):
                raise ValueError(f"layer {i}: {key} is not a contiguous {_NAME[dtype]} CPU vector "
                                 f"of {n}")
        panels = {"qkv_w": (qkv, hidden), "o_w": (hidden, q), "gate_up_w": (padded, hidden),
                  "down_w": (hidden, inter)}
        for key, (n, k) in panels.items():
            ok = (_quant_ok(layer[key], *fmt[key], n, k, panel) if key in fmt
                  else _packed_ok(layer[key], n, k, panel, dtype))
            if not ok:
                raise ValueError(f"layer {i}: {key} is not a packed [{n}, {k}] weight")
    qk_norm = [layer.get("q_norm") is not None for layer in layers]
    if any(qk_norm) and not all(qk_norm):
        raise ValueError("q_norm must be given for every layer or for none")
    sandwich = [layer.get("attn_out_norm") is not None for layer in layers]
    if any(sandwich) and not (all(sandwich) and all(layer.get("mlp_out_norm") is not None
                                                    for layer in layers)):
        raise ValueError("attn_out_norm and mlp_out_norm must be given for every layer or none")
    if any(qk_norm) and dtype != torch.float32:
        raise ValueError("no q/k norm in the bf16 stack")
    for i, layer in enumerate(layers):
        for key in ("q_norm", "k_norm"):
            if any(qk_norm) and (layer.get(key) is None or not _f32_vector(layer[key], head_dim)):
                raise ValueError(f"layer {i}: {key} is not a contiguous fp32 CPU vector of "
                                 f"{head_dim}")
    return qk_norm


def _check_tables(tables: list[tuple[torch.Tensor, torch.Tensor]], head_dim: int,
                  dtype: torch.dtype) -> None:
    """ValueError unless every (cos, sin) is a contiguous [positions, head_dim / 2] pair of
    one shape and the stack's dtype."""
    shape = tables[0][0].shape
    for cos, sin in tables:
        if (cos.dtype != dtype or sin.dtype != dtype or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.shape != shape or sin.shape != shape
                or cos.dim() != 2 or cos.shape[-1] * 2 != head_dim):
            raise ValueError(f"the rotary tables must be contiguous {_NAME[dtype]} "
                             "[positions, head_dim / 2], all of one shape")


def _quant_formats(layers: list[dict]) -> tuple[Any, Any, bool]:
    """Each layer's (bits, group) per projection as the struct's arrays (0: float), and
    whether any projection is quantized."""
    formats = [(layer.get("formats") or {}).get(key, (0, 0)) for layer in layers
               for key in ("qkv_w", "o_w", "gate_up_w", "down_w")]
    bits = (ctypes.c_int32 * len(formats))(*[b for b, _ in formats])
    groups = (ctypes.c_int64 * len(formats))(*[g for _, g in formats])
    return bits, groups, any(b for b, _ in formats)


class DecoderStack:
    """A Llama-family decoder stack's weights, laid out for `kp_decoder_stack_f32` (or, with
    bf16 norms, tables and caches, `kp_decoder_stack_bf16`: weights from
    `pack_gemm_weight_bf16`, gate/up one plain packed [2 * inter, hidden] weight with a plain
    bias, no q/k norm; the dtype is `final_norm`'s). A layer's optional `formats` maps a
    weight key (`qkv_w`, `o_w`, `gate_up_w`, `down_w`) to (bits, group) for a weight-only
    quantized projection packed by `pack_q4`/`pack_q8` (gate/up then the fused
    `[2 * inter, hidden]` weight, its bias unpadded; bf16 stacks: an even group, bf16 biases).

    `layers` holds, per layer, the packed weights (`pack_gemm_weight`; gate/up from
    `pack_gate_up_weight`, its bias from `pack_gate_up_bias`) and optional biases of
    qkv / o / gate_up / down, the two norm weights and, for Qwen3 and Gemma 3, the per-head
    `q_norm` and `k_norm` weights (in every layer or in none); `windows` gives each layer's
    sliding window (None: global attention). Gemma's layer (fp32 only): `attn_out_norm` and
    `mlp_out_norm` per layer (the norms of the attention and MLP outputs; `post_norm` is then
    the MLP's input norm; every norm weight as the kernel multiplies by it, i.e. 1 + w),
    `gelu` (GeGLU), `softcap` (the attention scores') and `layer_tables` (each layer's own
    (cos, sin), for Gemma 3's local rotary base). The tensors are kept referenced here so the pointers stay valid. `run` takes one step's embeddings and metadata and returns the
    final normed hidden state, the same values the per-layer modules compute. Its activation
    scratch is reused from step to step, so one stack serves one step at a time (as the engine
    runs them).
    """

    _KEYS = ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
             "down_w", "down_b")

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], final_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, hidden: int, heads: int,
                 kv_heads: int, head_dim: int, inter: int, eps: float, scale: float,
                 windows: list[int | None] | None = None, gelu: bool = False,
                 softcap: float | None = None,
                 layer_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if not gemm_available():
            raise ValueError("the native GEMM is not available (the library is not loaded)")
        panel, dtype = gemm_panel(), final_norm.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("the native stack runs float32 or bfloat16 models")
        q, kv = heads * head_dim, kv_heads * head_dim
        # fp32: gate/up as panel pairs (gemm_silu); bf16: plain, SiLU after the product
        padded = 2 * -(-inter // panel) * panel if dtype == torch.float32 else 2 * inter
        qk_norm = _check_layers(layers, (hidden, q + 2 * kv, q, inter), panel, dtype, head_dim)
        windows = windows or [None] * len(layers)
        if len(windows) != len(layers) or any(w is not None and not 0 < w < 2**31
                                               for w in windows):
            raise ValueError("windows: one positive window (or None) per layer")
        if not _f32_vector(final_norm, hidden, dtype):
            raise ValueError("final_norm is not a contiguous CPU vector")
        _check_tables([(cos, sin)] + (layer_tables or []), head_dim, dtype)
        if layer_tables is not None and len(layer_tables) != len(layers):
            raise ValueError("layer_tables: one (cos, sin) per layer")
        gemma = gelu or bool(softcap) or layer_tables is not None or any(
            layer.get("attn_out_norm") is not None for layer in layers)
        if gemma and dtype != torch.float32:
            raise ValueError("Gemma's layer (its norms, GELU, soft cap, tables) runs in fp32 only")
        if gelu and any("gate_up_w" in (layer.get("formats") or {}) for layer in layers):
            raise ValueError("GELU needs gate/up as fp32 panel pairs (not quantized)")
        if heads % kv_heads or heads // kv_heads > 32 or head_dim > 256 or head_dim % 2:
            raise ValueError("head layout outside the native attention kernel's limits")
        self._keep = (layers, final_norm, cos, sin, layer_tables)
        self.num_layers = len(layers)
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.inter, self._gate_up_width, self.dtype = inter, padded, dtype
        keys = self._KEYS + (("q_norm", "k_norm") if any(qk_norm) else ()) + (
            ("attn_out_norm", "mlp_out_norm") if layers[0].get("attn_out_norm") is not None
            else ())
        self._arrays = {key: (ctypes.c_void_p * len(layers))(
            *[(layer[key].data_ptr() if layer.get(key) is not None else None) for layer in layers])
            for key in keys}
        self._windows = (ctypes.c_int32 * len(layers))(*[w or 0 for w in windows])
        tables = {name: ctypes.cast((ctypes.c_void_p * len(layers))(
            *[t[i].data_ptr() for t in layer_tables]), _ptrs)
            for i, name in enumerate(("layer_cos", "layer_sin"))} if layer_tables else {}
        self._tables = tables
        self._qbits, self._qgroup, quantized = _quant_formats(layers)
        self._struct = abi.DecoderStackStruct(
            layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, inter=inter, max_positions=cos.shape[0], eps=eps, scale=scale,
            final_norm=final_norm.data_ptr(), cos_table=cos.data_ptr(), sin_table=sin.data_ptr(),
            window=ctypes.addressof(self._windows) if any(windows) else None,
            qbits=ctypes.addressof(self._qbits) if quantized else None,
            qgroup=ctypes.addressof(self._qgroup) if quantized else None,
            softcap=softcap or 0.0, gelu=int(gelu), **tables,
            **{key: ctypes.cast(arr, _ptrs) for key, arr in self._arrays.items()})
        self._kv_key: tuple | None = None
        self._scratch = torch.empty(0, dtype=dtype)

    def takes_cache(self, cache: Any) -> bool:
        """Whether `run` takes caches like this one: a tensor of the stack's dtype, or a
        quantized cache (`QuantKV`: `.data` codes, `.scales`) of a format the native kernels
        read (a bf16 stack widens q, k and v to fp32 for it, as the per-layer path does)."""
        if isinstance(cache, torch.Tensor):
            return cache.dtype == self.dtype
        data = getattr(cache, "data", None)
        return isinstance(data, torch.Tensor) and kv_format(data) is not None

    def _bind_kv(self, kv_caches: list[Any]) -> None:
        # Addresses and shapes: a new cache at a freed cache's address must be checked again.
        key = tuple((c.data_ptr(), tuple(c.shape), c.dtype) for c in kv_caches) if isinstance(
            kv_caches[0], torch.Tensor) else tuple(
            (c.data.data_ptr(), c.scales.data_ptr(), tuple(c.shape), c.dtype) for c in kv_caches)
        if key == self._kv_key:
            return
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        fmt = 0
        if not isinstance(kv_caches[0], torch.Tensor):  # quantized: codes and scales
            fmt = kv_format(kv_caches[0].data)
            if not fmt or any(c.scales.shape != (2, c.shape[1], self.kv_heads)
                              or not c.scales.is_contiguous() or c.scales.dtype != torch.float32
                              or c.dtype != kv_caches[0].dtype for c in kv_caches):
                raise ValueError("a quantized KV cache needs int8/fp8 codes and float32 scales "
                                 "[2, blocks, kv_heads]")
            self._scale_array = (ctypes.c_void_p * len(kv_caches))(
                *(c.scales.data_ptr() for c in kv_caches))
            kv_caches = [c.data for c in kv_caches]
        shape = kv_caches[0].shape
        for c in kv_caches:
            if (c.device.type != "cpu" or c.dtype != (kv_caches[0].dtype if fmt else self.dtype)
                    or not c.is_contiguous()
                    or c.dim() != 5 or c.shape != shape or c.shape[0] != 2
                    or tuple(c.shape[3:]) != (self.kv_heads, self.head_dim)
                    or c.shape[2] > 256):
                raise ValueError(f"KV caches must be contiguous {_NAME[self.dtype]} CPU tensors "
                                 "[2, blocks, block_size <= 256, kv_heads, head_dim]")
        self._kv_array = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
        self._struct.kv = ctypes.cast(self._kv_array, _ptrs)
        self._struct.kv_format = fmt
        self._struct.kv_scales = ctypes.cast(self._scale_array, _ptrs) if fmt else None
        self._struct.num_blocks, self._struct.block_size = shape[1], shape[2]
        self._kv_key = key

    def _per_layer(self, groups: tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]],
                   t: int) -> dict[str, Any]:
        """The step struct's per-layer slots and tables (their tensors kept until the call
        returns)."""
        layer_group, tables = groups
        if self.dtype != torch.float32:
            raise ValueError("KV groups' tables per layer: the fp32 stack only")
        if len(layer_group) != self.num_layers or not all(0 <= g < len(tables)
                                                          for g in layer_group):
            raise ValueError("groups: one KV group per layer, each with its slots and tables")
        kept = [(s.to(torch.int64).contiguous(), b.to(torch.int32).contiguous())
                for s, b in tables]
        if any(s.dim() != 1 or s.numel() != t or b.dim() != 2 for s, b in kept):
            raise ValueError("each group's slots must be [tokens] and its tables [seqs, blocks]")
        self._groups_kept = kept
        n = self.num_layers
        return {"layer_slots": ctypes.cast((ctypes.c_void_p * n)(
                    *[kept[g][0].data_ptr() for g in layer_group]), _ptrs),
                "layer_tables": ctypes.cast((ctypes.c_void_p * n)(
                    *[kept[g][1].data_ptr() for g in layer_group]), _ptrs),
                "layer_bt_stride": ctypes.cast((ctypes.c_int64 * n)(
                    *[kept[g][1].stride(0) for g in layer_group]), ctypes.c_void_p)}

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            kv_caches: list[Any], block_tables: torch.Tensor, row_lens: torch.Tensor,
            seq_idx: torch.Tensor,
            groups: tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
            ) -> torch.Tensor:
        """x `[T, hidden]` embeddings (overwritten as scratch) -> final hidden `[T, hidden]`.

        positions/slots int64 `[T]`; token t is an attention row over the first row_lens[t]
        (int32) keys of block-table row seq_idx[t] (int64) of `block_tables` (int32).
        `groups`, for layers in several KV groups (fp32 only): each layer's group and each
        group's (slots, block_tables), group 0's being `slots` and `block_tables`."""
        lib = loaded()
        t = x.shape[0]
        if not (x.dtype == self.dtype and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.hidden):
            raise ValueError(f"x must be contiguous {_NAME[self.dtype]} [tokens, hidden]")
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
        per_layer = self._per_layer(groups, t) if groups is not None else {}
        self._bind_kv(kv_caches)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # Each activation gets its own contiguous [T, n] block of one allocation.
        sizes = {"residual": self.hidden, "normed": self.hidden, "qkv": q + 2 * kv, "attn": q,
                 "gate_up": self._gate_up_width, "act": self.inter}
        need = t * sum(sizes.values())
        if self._scratch.numel() < need:
            # Kept between steps: a fresh buffer per step would fault all its pages in again.
            self._scratch = torch.empty(need, dtype=self.dtype)
        scratch = self._scratch
        out = torch.empty((t, self.hidden), dtype=self.dtype)
        ptrs, base = {}, scratch.data_ptr()
        for name, n in sizes.items():
            ptrs[name] = base
            base += t * n * scratch.element_size()
        tok_idx = torch.arange(t, dtype=torch.int64)
        step = abi.DecoderStepStruct(
            tokens=t, x=x.data_ptr(), out=out.data_ptr(), positions=positions.data_ptr(),
            slots=slots.data_ptr(), block_tables=block_tables.data_ptr(),
            bt_stride=block_tables.stride(0), row_lens=row_lens.data_ptr(),
            tok_idx=tok_idx.data_ptr(), seq_idx=seq_idx.data_ptr(), **per_layer, **ptrs)
        sync_threads(lib)
        fn = lib.kp_decoder_stack_f32 if self.dtype == torch.float32 else lib.kp_decoder_stack_bf16
        rc = fn(ctypes.byref(self._struct), ctypes.byref(step))
        self._groups_kept = None
        if rc != 0:
            exc, msg = _STACK_ERRORS.get(rc, (RuntimeError, f"decoder stack failed ({rc})"))
            raise exc(msg)
        return out
