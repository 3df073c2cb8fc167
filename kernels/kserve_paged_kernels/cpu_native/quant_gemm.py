"""Weight-only quantized matrix products with float32 or bfloat16 activations
(`csrc/quant_gemm.c`).

Why: PyTorch's packed int4/int8 CPU kernels are fast in bfloat16 only; float32 activations,
which keep a GGUF's scales exact, take their slow path (10-90x `F.linear`). The native kernel
dequantizes in registers, so a decode step reads 4 or 8 bits per weight plus its group's scales.
In bfloat16 it dequantizes each weight panel once into bf16 pairs from a few rows on and runs
the bf16 GEMM's micro-kernel over them (`gemm_bf16.py`), where PyTorch's int4 kernel falls
behind dense bf16 at batch and prefill sizes; `native_bf16_quant` says where it is chosen.

A weight is packed once into the layout `csrc/quant_gemm.c` describes: column panels of
`gemm_panel()` outputs (the loaded level's width), each a run of group blocks of scales
(and minimums for 4 bits) and codes. A packed weight fits the library it was packed for. The
convention for "cannot run here" is the package's (kernels/kserve_paged_kernels/cpu_native/__init__.py).
"""

from __future__ import annotations

import torch

from kserve_paged_kernels.cpu_native.huge_pages import on_huge_pages
from kserve_paged_kernels.cpu_native.loader import gemm_panel, load, loaded_level, sync_threads
from kserve_paged_kernels.cpu_native.ops import rows_of


def quant_available() -> bool:
    """True when the library is loaded (the kernel is in every level's build)."""
    return gemm_panel() > 0


# Levels whose bf16 variant was measured faster than PyTorch's int4 kernel (bf16 activations,
# SmolLM2-135M's projections at 16-512 rows, and the one-call stack it allows; BENCHMARKS.md
# "Quantized weights with bf16 activations"): Zen 5. The other levels are not measured on
# their own machine types (capping our level here leaves PyTorch's kernel on this CPU's best
# path, so it says nothing of theirs): they keep PyTorch's kernel until measured.
BF16_QUANT_LEVELS = ("avx512_bf16",)


def native_bf16_quant() -> bool:
    """Whether weight-only quantized projections with bf16 activations take `quant_gemm`
    (the loaded level is in `BF16_QUANT_LEVELS`) rather than PyTorch's packed kernels."""
    level = loaded_level()
    return level is not None and level.name in BF16_QUANT_LEVELS


def _panels(t: torch.Tensor, panel: int) -> torch.Tensor:
    """`[N, ...]` -> `[P, panel, ...]`, zero rows past N."""
    pad = -t.shape[0] % panel
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, panel, *t.shape[1:])


def _block_rows(t: torch.Tensor, panel: int, groups: int) -> torch.Tensor:
    """Per-group values `[N, groups]` (float32) -> bytes `[P, groups, 4 * panel]`."""
    p = _panels(t.float().contiguous(), panel).transpose(1, 2).contiguous()
    return p.view(torch.uint8).reshape(p.shape[0], groups, 4 * panel)


def _check(codes: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[int, int, int]:
    n, k = codes.shape
    if group <= 0 or k % group or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"scales {tuple(scale.shape)} do not fit a [{n}, {k}] weight in groups "
                         f"of {group}")
    panel = gemm_panel()
    if not panel:
        raise RuntimeError("the native CPU kernels are not loaded (check quant_available())")
    return n, k, panel


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
            group: int) -> torch.Tensor:
    """Codes `[N, K]` (0..15) with per-group `scale` and `minimum` `[N, K / group]`
    (`w = q * scale + minimum`) -> the packed bytes for `quant_gemm(..., bits=4)`."""
    n, k, panel = _check(codes, scale, group)
    if group % 2:
        raise ValueError("4-bit groups hold an even number of weights")
    groups = k // group
    q = _panels(codes.to(torch.uint8).reshape(n, groups, group // 2, 2), panel)
    pairs = q[..., 0] | (q[..., 1] << 4)  # [P, panel, groups, group / 2]
    nib = pairs.permute(0, 2, 3, 1).reshape(-1, groups, group // 2 * panel)
    blocks = torch.cat([_block_rows(scale, panel, groups), _block_rows(minimum, panel, groups),
                        nib], dim=-1)
    return on_huge_pages(blocks.reshape(-1))


def pack_q8(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """int8 codes `[N, K]` with per-group `scale` `[N, K / group]` (`w = q * scale`; a group
    of K is one scale per output channel) -> the packed bytes for `quant_gemm(..., bits=8)`."""
    n, k, panel = _check(codes, scale, group)
    groups = k // group
    q = _panels(codes.to(torch.int8).view(torch.uint8).reshape(n, groups, group), panel)
    rows = q.permute(0, 2, 3, 1).reshape(-1, groups, group * panel)
    return on_huge_pages(torch.cat([_block_rows(scale, panel, groups), rows], dim=-1).reshape(-1))


def pack_e4m3(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 e4m3 codes `[N, K]` with per-group `scale` `[N, K / group]` (`w = fp8(q) * scale`)
    -> the packed bytes for `quant_gemm(..., bits=QUANT_E4M3)`: `pack_q8`'s layout, the codes'
    bytes as they are, the scales times 2^8 (exact; the kernel decodes a code to 2^-8 of its
    value, csrc/quant_gemm.c)."""
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3 codes expected, got {codes.dtype}")
    return pack_q8(codes.view(torch.int8), scale.float() * 256.0, group)


def q8_rows(packed: torch.Tensor, group: int, in_features: int, ids: torch.Tensor
            ) -> torch.Tensor:
    """Rows `ids` of a `pack_q8` weight, dequantized to float32 `[*ids.shape, in_features]`
    (an embedding's lookup over the LM head's codes)."""
    panel = gemm_panel()
    groups = in_features // group
    blocks = packed.view(-1, groups, 4 * panel + group * panel)
    scale = blocks[..., :4 * panel].contiguous().view(torch.float32)  # [P, groups, panel]
    codes = blocks[..., 4 * panel:].view(torch.int8).view(-1, groups, group, panel)
    flat = ids.reshape(-1)
    p, j = flat // panel, flat % panel
    w = codes[p, :, :, j].float() * scale[p, :, j].unsqueeze(-1)  # [n, groups, group]
    return w.reshape(*ids.shape, in_features)


def quant_gemm(x: torch.Tensor, packed: torch.Tensor, bits: int, group: int, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ w.T (+ bias)` for float32 or bfloat16 rows `x` `[M, K]` (bias and result in x's
    dtype; bf16: fp32 sums, each output rounded once) and a weight from `pack_q4`/`pack_q8`;
    None when the library is not loaded or `x`, `bias` or the packing do not fit (bf16: also
    an odd group)."""
    lib = load()
    dtype = x.dtype
    if (lib is None or dtype not in (torch.float32, torch.bfloat16) or not rows_of(x, dtype)
            or packed.dtype != torch.uint8):
        return None
    k = x.shape[1]
    blk = int(lib.kp_quant_block_bytes(bits, group))
    panel = gemm_panel()
    if (blk < 0 or k % group or not packed.is_contiguous()
            or packed.numel() != -(-out_features // panel) * (k // group) * blk
            or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()
                                      or bias.numel() != out_features))):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=dtype)
    sync_threads(lib)
    fn = lib.kp_quant_gemm_f32 if dtype == torch.float32 else lib.kp_quant_gemm_bf16
    rc = fn(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), bits, group, k,
            out_features, bias.data_ptr() if bias is not None else None, out.data_ptr(),
            out_features)
    return out if rc == 0 else None
