"""Small C kernels for CPU serving (`kernels/kserve_paged_kernels/csrc`), built with the system C compiler and
called through ctypes.

Why: on CPU the PyTorch path copies every decode row's blocks into a contiguous tensor and
reads that copy again in SDPA; decode is bound by that memory traffic, and a layer's
elementwise ops are several passes each. The native kernels read K/V once from the paged cache,
fuse the elementwise ops into one pass each, multiply by weights packed once into panels, and
run a whole decoder stack in one call (`DecoderStack`), so a step pays no per-layer Python.

The modules, one job each:
- `loader`: builds the library into the cache (keyed by sources, flags, compiler and CPU) and
  loads it, refusing a library of another ABI version;
- `abi`: the ctypes view of `csrc/kp_native.h` (version, signatures, struct mirrors);
- `ops`: paged attention and the fused elementwise ops;
- `ops_gemma`: Gemma's (its norms times fp32 `1 + w`, the bf16 tanh-GELU-and-multiply);
- `gemm`: weight packing (in the loaded level's panel width) and the matrix products;
- `gemm_bf16`: the bf16 product over weights packed in bf16 pairs;
- `decoder_stack`: `DecoderStack`;
- `lora`: the LoRA delta of a step's adapters in one call per projection;
- `quant_gemm`: int4/int8 (and fp8 e4m3) weights packed once, multiplied with float32 or bf16
  activations;
- `kvq`: a quantized KV cache (`--kv-cache-dtype`): its store and attention over the codes.
- `huge_pages`: the 2 MiB-page memory packed weights (and the KV cache) live on.
Callers use the names re-exported here (`from kserve_paged_kernels import cpu_native`).

"Cannot run here" is said one way. The library cannot run a call when it is not loaded (no
compiler, a failed build, an ABI mismatch, `KSERVE_PAGED_NATIVE=0`; the reason is logged once)
or when the tensors are not in the kernel's layout (fp32 CPU, rows with unit stride, within
the kernel's limits). Then a wrapper does nothing and returns None, and the caller runs its
PyTorch path; when it ran, it returns its result (a tensor, or True for the in-place
`rope_inplace` and `store_kv`). `usable()` and `gemm_available()` answer the question ahead of
time for the two callers that must know before they start: `paged_rows` and `DecoderStack.run`
expect that check and raise RuntimeError without the library, and `DecoderStack()` raises
ValueError for weights it cannot take. Exceptions otherwise mean a wrong value that torch would
refuse too (IndexError: a position or KV slot out of range; ValueError: inconsistent shapes)
or an allocation failure (MemoryError).
"""

from kserve_paged_kernels.cpu_native.decoder_stack import DecoderStack
from kserve_paged_kernels.cpu_native.gemm import (
    gemm,
    gemm_available,
    gemm_gelu,
    gemm_silu,
    pack_gate_up_bias,
    pack_gate_up_weight,
    pack_gemm_weight,
    prefill_tiles,
    unpack_gate_up_weight,
    unpack_gemm_weight,
)
from kserve_paged_kernels.cpu_native.gemm_bf16 import (
    gemm_bf16,
    native_bf16_linear,
    pack_gemm_weight_bf16,
)
from kserve_paged_kernels.cpu_native.huge_pages import on_huge_pages
from kserve_paged_kernels.cpu_native.kvq import kvq_usable, paged_rows_q8, store_kv_q8
from kserve_paged_kernels.cpu_native.loader import gemm_panel, load
from kserve_paged_kernels.cpu_native.lora import LoRASegments, lora_sgmv, lora_sgmv_segments
from kserve_paged_kernels.cpu_native.ops import (
    add_rms_norm,
    argmax_rows,
    bf16_prefill_tiles,
    copy_blocks,
    paged_rows,
    qk_norm_inplace,
    rope_inplace,
    silu_mul,
    store_kv,
    usable,
)
from kserve_paged_kernels.cpu_native.ops_gemma import (
    gelu_mul,
    gemma_add_rms_norm,
    gemma_qk_norm_inplace,
)
from kserve_paged_kernels.cpu_native.quant_gemm import (
    native_bf16_quant,
    pack_e4m3,
    pack_q4,
    pack_q8,
    q8_rows,
    quant_available,
    quant_gemm,
)

__all__ = [
    "DecoderStack",
    "add_rms_norm",
    "argmax_rows",
    "bf16_prefill_tiles",
    "copy_blocks",
    "LoRASegments",
    "lora_sgmv",
    "lora_sgmv_segments",
    "gemm",
    "gemm_bf16",
    "gemm_available",
    "gemm_panel",
    "gemm_gelu",
    "gelu_mul",
    "gemma_add_rms_norm",
    "gemma_qk_norm_inplace",
    "gemm_silu",
    "kvq_usable",
    "load",
    "native_bf16_linear",
    "native_bf16_quant",
    "on_huge_pages",
    "pack_gate_up_bias",
    "pack_gate_up_weight",
    "pack_gemm_weight",
    "pack_gemm_weight_bf16",
    "pack_e4m3",
    "pack_q4",
    "pack_q8",
    "paged_rows",
    "paged_rows_q8",
    "prefill_tiles",
    "q8_rows",
    "quant_available",
    "quant_gemm",
    "qk_norm_inplace",
    "rope_inplace",
    "silu_mul",
    "store_kv",
    "store_kv_q8",
    "unpack_gate_up_weight",
    "unpack_gemm_weight",
    "usable",
]
