/* The C ABI of the native CPU library: every exported function and the structs they take.
 *
 * Every .c file of the library includes this header, and kernels/kserve_paged_kernels/cpu_native/abi.py declares
 * the same functions to ctypes; tests/kernels/test_native_abi.py parses this file and checks
 * that the two agree. Change a signature or a struct here, in abi.py and in KP_ABI_VERSION
 * together: cpu_native.load() refuses a library whose kp_abi_version() differs from the
 * version abi.py expects (the PyTorch path serves instead).
 *
 * Tensors are passed as raw pointers with their row strides in elements; every kernel works in
 * fp32. Return codes: 0 success, negative an error the caller maps to an exception.
 */
#ifndef KP_NATIVE_H
#define KP_NATIVE_H

#include <stdint.h>

#define KP_ABI_VERSION 14

/* Output columns per packed GEMM weight panel: three vectors where the register file holds 32
 * (AVX-512: an 8 x 48 tile), two where it holds 16 (AVX2: 6 x 16). A packed weight fits only
 * the level it was packed for: the Python side packs with what the loaded library reports
 * (kp_gemm_panel). */
#if defined(__AVX512F__)
#define KP_GEMM_PANEL 48
#else
#define KP_GEMM_PANEL 16
#endif

#define KP_API __attribute__((visibility("default")))

/* The instruction-set level this build was compiled for, from the compiler's own macros; the
 * names are kernels/kserve_paged_kernels/cpu_native/isa.py's levels, and library.c embeds the one chosen here so a
 * test can read what a cross-compiled library contains without running it. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KP_ISA "amx"
#elif defined(__AVX512BF16__)
#define KP_ISA "avx512_bf16"
#elif defined(__AVX512F__)
#define KP_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define KP_ISA "avx2"
#else
#define KP_ISA "generic"
#endif

/* ---- library (library.c) ---- */

/* KP_ABI_VERSION of the sources this library was built from. */
KP_API int kp_abi_version(void);

/* OpenMP threads for the library's parallel regions of the calling thread (n > 0). */
KP_API void kp_set_threads(int n);

/* ---- paged attention (paged_dispatch.c and the paged_*.c files) ---- */

/* Attention of n query rows read straight from the paged KV cache
 * kv = [2, num_blocks, block_size, num_kv_heads, head_dim]: row r is query row tok_idx[r] of
 * the sequence whose block-table row is seq_idx[r] and sees its first row_lens[r] keys, or
 * with window > 0 only the last `window` of them (a sliding-window layer); softcap > 0
 * replaces each scaled score s by softcap * tanh(s / softcap) before the softmax (0: none).
 * The output goes to the same row of out. -1: shape or argument outside the kernel's limits,
 * -2: scratch could not be allocated. */
KP_API int kp_paged_rows_f32(const float *q, int64_t q_row_stride, const float *kv,
                             int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                             int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                             const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                             float softcap, float *out, int64_t out_row_stride);

/* kp_paged_rows_f32 with attention sinks (gpt-oss): sinks holds one logit per query head,
 * added to that head's softmax denominator as exp(sink) (a score whose value row is zero);
 * NULL is kp_paged_rows_f32. Rows take the row kernel (no transposed-key tiles). */
KP_API int kp_paged_rows_sinks_f32(const float *q, int64_t q_row_stride, const float *kv,
                                   int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                                   int32_t head_dim, int32_t num_heads,
                                   const int32_t *block_tables, int64_t bt_stride,
                                   const int32_t *row_lens, const int64_t *tok_idx,
                                   const int64_t *seq_idx, int64_t n, float scale,
                                   int32_t window, float softcap, const float *sinks, float *out,
                                   int64_t out_row_stride);

/* kp_paged_rows_sinks_f32 over a bfloat16 cache: kp_paged_rows_bf16 with sinks (fp32). */
KP_API int kp_paged_rows_sinks_bf16(const uint16_t *q, int64_t q_row_stride,
                                    const uint16_t *kv, int64_t num_blocks, int32_t block_size,
                                    int32_t num_kv_heads, int32_t head_dim, int32_t num_heads,
                                    const int32_t *block_tables, int64_t bt_stride,
                                    const int32_t *row_lens, const int64_t *tok_idx,
                                    const int64_t *seq_idx, int64_t n, float scale,
                                    int32_t window, float softcap, const float *sinks,
                                    uint16_t *out, int64_t out_row_stride);

/* out[m, n] = x[m, :] . W[n, :] + bias[n] (bias may be NULL) for M rows of K floats, W's N rows
 * stored as MXFP4 (mxfp4_gemm.c): blocks [N, K / 32, 16] (two E2M1 codes a byte, the even
 * column low), scales [N, K / 32] (E8M0, biased by 127). -1: K not a multiple of 32 or a
 * negative size, -2: scratch could not be allocated. */
KP_API int kp_mxfp4_linear_f32(const float *x, int64_t x_stride, int64_t M,
                               const uint8_t *blocks, const uint8_t *scales, int64_t N,
                               int64_t K, const float *bias, float *out, int64_t out_stride);

/* kp_paged_rows_f32 over a bfloat16 cache (paged_bf16.c): q, kv and out hold bf16 bits;
 * scores, softmax and sums are fp32, each output rounded to bf16 once (nearest even). Same
 * arguments, limits and return codes. */
KP_API int kp_paged_rows_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                              int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                              int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                              int64_t bt_stride, const int32_t *row_lens,
                              const int64_t *tok_idx, const int64_t *seq_idx, int64_t n,
                              float scale, int32_t window, float softcap, uint16_t *out,
                              int64_t out_row_stride);

/* ---- a quantized KV cache (--kv-cache-dtype; kv_q8.c, paged_q8.c) ---- */

/* The code formats: one byte per element, `codes` [2, num_blocks, block_size, num_kv_heads,
 * head_dim] and one fp32 scale per (K/V half, block, KV head), `scales` [2, num_blocks,
 * num_kv_heads]; an element's value is code * scale (kernels/kserve_paged_kernels/kv_quant.py). */
#define KP_KV_INT8 1 /* int8, -127 .. 127 */
#define KP_KV_E4M3 2 /* float8_e4m3fn */
#define KP_KV_E5M2 3 /* float8_e5m2 */

/* Quantize rows of k and v ([n, num_kv_heads * head_dim] with row strides) into their slots,
 * as kernels/kserve_paged_kernels/kv_quant.py's store_kv_quant does it, code for code: a write at a block's first
 * slot resets its scales; a (block, head) whose scale the new rows outgrow gets the larger
 * scale and its codes requantized to it. Slots < 0 skipped. -1, writing nothing: a slot
 * outside the cache or an unknown format; -2: no memory for the scratch. */
KP_API int kp_store_kv_q8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                          const int64_t *slots, int64_t n, uint8_t *codes, float *scales,
                          int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                          int32_t head_dim, int32_t format);

/* kp_paged_rows_f32 over a quantized cache (codes and scales as above): fp32 query and output,
 * each K/V code widened and scaled in fp32, fp32 softmax and sums. Single rows read the codes
 * directly; rows of a sequence that has several in the call (a prefill chunk) go through the
 * fp32 kernel over that sequence's blocks dequantized once into scratch (its transposed-key
 * tiles). Same limits and return codes as kp_paged_rows_f32, and -1 for an unknown format. */
KP_API int kp_paged_rows_q8(const float *q, int64_t q_row_stride, const uint8_t *codes,
                            const float *scales, int32_t format, int64_t num_blocks,
                            int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                            int32_t num_heads, const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *row_lens, const int64_t *tok_idx,
                            const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                            float softcap, float *out, int64_t out_row_stride);

/* ---- fused elementwise ops (cpu_ops.c) ---- */

/* out[t] = w * rmsnorm(x[t] (+ residual[t])); with a residual, residual[t] becomes the sum. */
KP_API void kp_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual,
                                const float *w, float *out, int64_t rows, int64_t hidden,
                                float eps);

/* Per-head RMSNorm in place on fused qkv rows (Qwen3's q/k norm): in each row the first q_heads
 * heads times q_w, the next k_heads times k_w (each [head_dim]). */
KP_API void kp_qk_norm_f32(float *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                           int64_t k_heads, int64_t head_dim, const float *q_w, const float *k_w,
                           float eps);

/* Rotary embedding in place on the first `heads` heads of each row; -1: a position outside
 * the table. */
KP_API int kp_rope_f32(float *x, int64_t row_stride, const int64_t *positions,
                       const float *cos_table, const float *sin_table, int64_t max_positions,
                       int64_t rows, int64_t heads, int64_t head_dim);

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i]. */
KP_API void kp_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter);

/* Rows of k and v into their slots of a [2, num_slots, row_floats] cache (slots < 0 skipped);
 * -1, writing nothing: a slot outside the cache. */
KP_API int kp_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                           const int64_t *slots, int64_t n, float *cache, int64_t num_slots,
                           int64_t row_floats);

/* Copy-on-write: in each of `layers` caches [2, num_blocks, block_bytes] (any dtype, counted
 * in bytes), block dst[i] := block src[i], keys and values; -1, copying nothing: an index
 * outside the cache. */
KP_API int kp_copy_blocks(void *const *caches, int64_t layers, int64_t num_blocks,
                          int64_t block_bytes, const int64_t *src, const int64_t *dst,
                          int64_t n);

/* out[r] = argmax of row r, with torch.argmax's tie and NaN rules. */
KP_API void kp_argmax_rows_f32(const float *x, int64_t row_stride, int64_t rows, int64_t cols,
                               int64_t *out);

/* ---- fused elementwise ops over bf16 (cpu_ops_bf16.c): the _f32 ops' arguments with bf16
 * tensors; fp32 inside, rounded where transformers rounds in bf16 ---- */

KP_API void kp_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                                 const uint16_t *w, uint16_t *out, int64_t rows, int64_t hidden,
                                 float eps);

KP_API void kp_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter);

KP_API int kp_store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v,
                            int64_t v_stride, const int64_t *slots, int64_t n, uint16_t *cache,
                            int64_t num_slots, int64_t row_elems);

KP_API int kp_rope_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions,
                        const uint16_t *cos_table, const uint16_t *sin_table,
                        int64_t max_positions, int64_t rows, int64_t heads, int64_t head_dim);

/* ---- Gemma's elementwise ops over bf16 (gemma_bf16.c): rounded where transformers' Gemma
 * rounds, which is not the Llama order above ---- */

/* kp_add_rms_norm_bf16 with an fp32 weight w = 1 + Gemma's weight: the row (the bf16 sum with
 * a residual, stored there) normalised and multiplied by w in fp32, rounded once. */
KP_API void kp_add_rms_norm_gemma_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                                       const float *w, uint16_t *out, int64_t rows,
                                       int64_t hidden, float eps);

/* kp_qk_norm_f32 over bf16 rows with fp32 weights (1 + Gemma's), each head rounded as above. */
KP_API void kp_qk_norm_gemma_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                                  int64_t k_heads, int64_t head_dim, const float *q_w,
                                  const float *k_w, float eps);

/* out[t, i] = bf16(bf16(gelu_tanh(gu[t, i])) * gu[t, inter + i]) (GeGLU, torch's tanh form). */
KP_API void kp_gelu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter);

/* ---- LoRA (lora_sgmv.c) ---- */

/* Largest adapter rank (after zero padding to the slot stack's rank) the kernel takes. */
#define KP_LORA_MAX_RANK 256

/* For each segment s and each of its rows r = rows[seg_start[s] .. + seg_len[s]]:
 * out[r] += scales[slot] * B[slot] @ (A[slot] @ x[r]) with slot = seg_slot[s];
 * a = [slots, rank, in_dim] and b_t = B transposed, [slots, rank, out_dim], both contiguous
 * (the padded ranks zero); x and out have x_rows rows; rows distinct. 0 on success; -1 a
 * row, segment or slot out of range, -2 rank outside 1..KP_LORA_MAX_RANK, -3 out of memory. */
KP_API int kp_lora_sgmv_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                            const float *a, const float *b_t, const float *scales, int64_t slots,
                            int64_t rank, int64_t in_dim, int64_t out_dim, int64_t x_rows,
                            const int64_t *rows, int64_t num_rows, const int64_t *seg_start,
                            const int64_t *seg_len, const int64_t *seg_slot, int64_t num_segs);

/* ---- GEMM over packed weights (gemm.c) ---- */

/* KP_GEMM_PANEL of this build: the panel width packed weights must have. */
KP_API int kp_gemm_panel(void);

/* y [M, N] = x [M, K] times a weight packed in KP_GEMM_PANEL-column panels (+ bias). */
KP_API int kp_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                       int64_t N, const float *bias, float *y, int64_t ldy);

/* act [M, inter] = silu(x Wg^T + bg) * (x Wu^T + bu), gate/up packed as panel pairs; gu is
 * scratch of [M, 2 * pairs * KP_GEMM_PANEL]. */
KP_API int kp_gemm_silu_f32(const float *x, int64_t ldx, int64_t M, const float *packed,
                            int64_t K, int64_t inter, const float *bias, float *gu, int64_t ldgu,
                            float *act, int64_t ldact);

/* The same with tanh-GELU for SiLU (GeGLU: Gemma): act = gelu_tanh(x Wg^T + bg) * (x Wu^T + bu). */
KP_API int kp_gemm_gelu_f32(const float *x, int64_t ldx, int64_t M, const float *packed,
                            int64_t K, int64_t inter, const float *bias, float *gu, int64_t ldgu,
                            float *act, int64_t ldact);

/* ---- weight-only quantized GEMM, float32 activations (quant_gemm.c) ---- */

/* `bits` value of a weight stored as fp8 e4m3 codes, one byte each, in the 8-bit layout. */
#define KP_QUANT_E4M3 9

/* Bytes of one packed group block (one panel of KP_GEMM_PANEL outputs, `group` weights along
 * k): bits 4, [scales][minimums][group / 2 rows of nibble pairs]; bits 8 (and KP_QUANT_E4M3),
 * [scales][group rows of int8 (e4m3) codes]; the layout is spelled out in quant_gemm.c. -1:
 * bits not 4, 8 or KP_QUANT_E4M3, or a group that is not positive (and even for 4 bits). */
KP_API int64_t kp_quant_block_bytes(int32_t bits, int64_t group);

/* y [M, N] = x [M, K] times a weight packed as above (+ bias): w = q * scale + minimum (4 bits)
 * or q * scale (8 bits; KP_QUANT_E4M3: q the code's fp8 value), dequantized in registers. -1: bits, group or K not as the packing
 * requires (K a multiple of group). */
KP_API int kp_quant_gemm_f32(const float *x, int64_t ldx, int64_t M, const uint8_t *packed,
                             int32_t bits, int64_t group, int64_t K, int64_t N,
                             const float *bias, float *y, int64_t ldy);

/* The same with bf16 x, bias and y: fp32 sums, each output rounded to bf16 once; past a few rows
 * (a few dozen for 4 bits with AVX512-BF16) the weights are rounded to bf16 too (quant_gemm.c
 * says when and why). -1 also for an odd group. */
KP_API int kp_quant_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *packed,
                              int32_t bits, int64_t group, int64_t K, int64_t N,
                              const uint16_t *bias, uint16_t *y, int64_t ldy);

/* ---- bf16 GEMM over pair-packed weights (gemm_bf16.c) ---- */

/* y [M, N] = bf16(x [M, K] times a weight packed in KP_GEMM_PANEL-column panels of bf16 pairs
 * (+ bias)), x, bias, y bf16, fp32 sums; -1: K odd. */
KP_API int kp_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *packed,
                        int64_t K, int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy);

/* ---- decoder stack (decoder_stack.c) ---- */

/* The model: sizes and, per layer, pointers to packed weights (gemm.c panels), biases
 * (NULL when absent), norm weights and the layer's KV cache [2, num_blocks, block_size,
 * num_kv_heads, head_dim]; per layer too, its sliding window in keys (0: none; `window` NULL:
 * no layer has one) and Qwen3's per-head q/k norm weights [head_dim] (`q_norm`, `k_norm`
 * NULL: none). Field order matches the ctypes mirror in abi.py. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    int64_t num_blocks, block_size, max_positions;
    float eps, scale;
    const float *const *in_norm;
    const float *const *post_norm;
    const float *const *qkv_w;
    const float *const *qkv_b;
    const float *const *o_w;
    const float *const *o_b;
    const float *const *gate_up_w;
    const float *const *gate_up_b;
    const float *const *down_w;
    const float *const *down_b;
    float *const *kv;
    const float *final_norm;
    const float *cos_table, *sin_table;
    const int32_t *window;
    const float *const *q_norm, *const *k_norm;
    /* Weight-only quantized projections: per layer, the format of qkv, o, gate_up and down
     * (entries 4 l .. 4 l + 3): 0 fp32 panels (gemm.c; gate/up as panel pairs), 4 or 8 a
     * quant_gemm.c weight in groups of qgroup[same entry] (gate/up then one [2 inter, hidden]
     * weight, gate rows first, and its bias unpadded). NULL: every projection fp32. */
    const int32_t *qbits;
    const int64_t *qgroup;
    /* A quantized KV cache (--kv-cache-dtype): kv_format a KP_KV_* format, each layer's kv
     * then its codes and kv_scales its scales (kp_store_kv_q8, kp_paged_rows_q8); 0 (and
     * kv_scales NULL): float caches. The bf16 stack widens q, k and v to fp32 for them and
     * rounds the attention output to bf16 once, as the per-layer modules do. */
    float *const *kv_scales;
    int64_t kv_format;
    /* Gemma's sandwich layer (NULL: Llama's pre-norm layer): per layer, the norm of the
     * attention output before its residual add and of the MLP output before its own (each
     * weight already 1 + w, as every Gemma norm weight given here); post_norm is then the
     * MLP's input norm. fp32 stack only. */
    const float *const *attn_out_norm, *const *mlp_out_norm;
    /* Per layer, its own rotary tables (Gemma 3's local layers have another base), each
     * [max_positions, head_dim / 2]; NULL: cos_table and sin_table for every layer. */
    const float *const *layer_cos, *const *layer_sin;
    float softcap; /* every layer's attention-score soft cap (Gemma 2); 0: none */
    int32_t gelu;  /* the MLP's activation: 0 SiLU, 1 tanh-GELU (GeGLU; fp32 panel pairs only) */
} kp_decoder_stack;

/* One step: T new tokens (their embeddings in x, which is overwritten) and scratch for each
 * activation; the final normed hidden state goes to out. The attention rows are the T tokens:
 * row t sees row_lens[t] keys of the sequence whose block-table row is seq_idx[t]. */
typedef struct {
    int64_t tokens;
    float *x, *residual, *normed, *qkv, *attn, *gate_up, *act, *out;
    const int64_t *positions, *slots;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *row_lens;
    const int64_t *tok_idx, *seq_idx;
    /* Layers in several KV groups (engine/kserve_paged_engine/core/kv_groups.py): per layer, its group's slots [T]
     * and block tables (row stride layer_bt_stride[l]); NULL: slots, block_tables and
     * bt_stride for every layer. The fp32 stack only. */
    const int64_t *const *layer_slots;
    const int32_t *const *layer_tables;
    const int64_t *layer_bt_stride;
} kp_decoder_step;

/* A whole stack of decoder layers for one step. 0 on success; -1 a position outside the
 * rotary table, -2 a KV slot outside the cache, -3 attention shape outside the kernel's limits,
 * -4 a GEMM refused its arguments, -5 the attention's scratch could not be allocated. */
KP_API int kp_decoder_stack_f32(const kp_decoder_stack *m, const kp_decoder_step *s);

/* The stack over bf16 with the same structs (decoder_stack.c says how their pointers are
 * read): weights pair-packed for kp_gemm_bf16 or, where qbits says so, quant_gemm.c weights
 * (kp_quant_gemm_bf16), everything else bf16; same return codes (-4 also for what only the
 * fp32 stack computes: q/k norm, Gemma's layer, KV groups' tables per layer). */
KP_API int kp_decoder_stack_bf16(const kp_decoder_stack *m, const kp_decoder_step *s);

#endif
