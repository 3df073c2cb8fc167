/* Team bodies of the kernels the decoder stacks run: each is its exported kernel without
 * the kernel's own `omp parallel`, its loops orphaned `omp for` constructs that end in their
 * implied barriers. Called by every thread of a parallel region they share the work among the
 * team, so a stack (decoder_stack.c) opens one region per step (bf16) or per layer (fp32: its
 * attention, paged_dispatch.c, keeps its own regions) instead of one per kernel (6-9 per layer:
 * each a fork, a join and a chance to wait on a descheduled thread); called
 * outside a region, one thread does all of it. The exported kernels are these bodies inside
 * their region, so both give the same bits.
 *
 * The bodies do not check their arguments: the caller has (the exported kernels' checks).
 * None is exported.
 */
#ifndef KP_TEAM_H
#define KP_TEAM_H

#include <stdint.h>

#include "kp_native.h"

/* kp_add_rms_norm_bf16's rows. */
void kp_team_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                               const uint16_t *w, uint16_t *out, int64_t rows, int64_t hidden,
                               float eps);

/* kp_silu_mul_bf16's rows. */
void kp_team_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter);

/* gemma_bf16.c's kernels' rows (kp_add_rms_norm_gemma_bf16, kp_qk_norm_gemma_bf16,
 * kp_gelu_mul_bf16). */
void kp_team_add_rms_norm_gemma_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                                     const float *w, uint16_t *out, int64_t rows,
                                     int64_t hidden, float eps);
void kp_team_qk_norm_gemma_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                                int64_t k_heads, int64_t head_dim, const float *q_w,
                                const float *k_w, float eps);
void kp_team_gelu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter);

/* kp_rope_bf16's rows (positions already in range); with a cache, each row's k and v (k_off
 * and v_off elements into the row, row_elems each) then go to its slot as kp_store_kv_bf16
 * stores them (slots already below num_slots; negative ones skipped). */
void kp_team_rope_store_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions,
                             const uint16_t *cos_table, const uint16_t *sin_table, int64_t rows,
                             int64_t heads, int64_t head_dim, const int64_t *slots,
                             uint16_t *cache, int64_t num_slots, int64_t k_off, int64_t v_off,
                             int64_t row_elems);

/* kp_gemm_bf16 (K even) and kp_quant_gemm_bf16 (blk: kp_quant_block_bytes(bits, group) >= 0,
 * K a multiple of an even group). */
void kp_team_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *packed,
                       int64_t K, int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy);
void kp_team_quant_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *packed,
                             int32_t bits, int64_t group, int64_t K, int64_t N,
                             const uint16_t *bias, uint16_t *y, int64_t ldy);

/* One step's attention plan, shared by the team: the rows' prefill runs (rows that share their
 * keys, which go through transposed keys) and the buffer for those keys. The runs depend on the
 * rows, not on the layer, so one plan serves every layer of a step; failed turns nonzero (and
 * stays so) where a layer's kernel would return -2. */
typedef struct {
    int32_t *group_of;
    void *grp;
    const uint32_t *kt;
    int64_t groups, slices;
    int failed;
    const float *sinks; /* one logit per query head (attention sinks), or NULL */
} kp_team_attention;

/* 1 when kp_paged_rows_bf16 takes these shapes (its -1 otherwise). */
int kp_team_attention_ok(int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                         int32_t num_heads, int32_t window, float softcap);

/* The plan (on one thread, outside the region: the transposed keys' buffer is the calling
 * thread's) and its release. */
void kp_team_attention_plan(kp_team_attention *sh, int32_t block_size, int32_t head_dim,
                            int32_t num_kv_heads, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *row_lens, const int64_t *seq_idx,
                            int64_t n, int32_t window, float softcap);
void kp_team_attention_free(kp_team_attention *sh);

/* kp_paged_rows_bf16 over a bf16 cache of shapes kp_team_attention_ok takes, with a plan made
 * for the same rows, window and cap; read sh->failed after it returns (every thread sees the
 * same value). */
void kp_team_paged_rows_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                             int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                             int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                             const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                             float softcap, uint16_t *out, int64_t out_row_stride,
                             kp_team_attention *sh);

/* The fp32 kernels': kp_add_rms_norm_f32's, kp_qk_norm_f32's and kp_silu_mul_f32's rows;
 * kp_rope_f32's rows with an optional store of each row's k and v, as kp_team_rope_store_bf16
 * (positions in range, slots below num_slots); kp_quant_gemm_f32 (its format checked). */
void kp_team_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w,
                              float *out, int64_t rows, int64_t hidden, float eps);
void kp_team_qk_norm_f32(float *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                         int64_t k_heads, int64_t head_dim, const float *q_w, const float *k_w,
                         float eps);
void kp_team_rope_store_f32(float *x, int64_t row_stride, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t rows,
                            int64_t heads, int64_t head_dim, const int64_t *slots, float *cache,
                            int64_t num_slots, int64_t k_off, int64_t v_off,
                            int64_t row_floats);
void kp_team_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter);
void kp_team_quant_gemm_f32(const float *x, int64_t ldx, int64_t M, const uint8_t *packed,
                            int32_t bits, int64_t group, int64_t K, int64_t N, const float *bias,
                            float *y, int64_t ldy);

#endif
