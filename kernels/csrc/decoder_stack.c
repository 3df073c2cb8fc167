/* A whole stack of pre-norm decoder layers (Llama family: RMSNorm, fused qkv with RoPE,
 * paged attention, output projection, RMSNorm, fused gate/up with SiLU, down projection) in one
 * call, on CPU in fp32, out of the other kernels of this library.
 *
 * Why: the same kernels called layer by layer from Python cost 5-7 ms a decode step in Python
 * and dispatch (module calls, argument checks, tensor allocation: ~10 calls a layer, 30
 * layers), 15-20% of a step at 8 rows. Here a step makes one call; the order of operations is
 * the per-layer path's, so the results are the same bit for bit (tests/kernels/
 * test_decoder_stack.py).
 *
 * The caller owns every buffer (activations for T rows, the attention rows' metadata) and
 * checks shapes; this file only runs the sequence and reports out-of-range positions or slots.
 * The gate/up weight comes as panel pairs (kp_gemm_silu_f32), as the MLP module packs it.
 */
#include <stdint.h>
#include <string.h>

void kp_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w,
                         float *out, int64_t rows, int64_t hidden, float eps);
int kp_rope_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
                const float *sin_table, int64_t max_positions, int64_t rows, int64_t heads,
                int64_t head_dim);
int kp_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *slots, int64_t n, float *cache, int64_t num_slots,
                    int64_t row_floats);
int kp_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                int64_t N, const float *bias, float *y, int64_t ldy);
int kp_gemm_silu_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                     int64_t inter, const float *bias, float *gu, int64_t ldgu, float *act,
                     int64_t ldact);
int kp_paged_rows_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t num_blocks,
                      int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                      int32_t num_heads, const int32_t *block_tables, int64_t bt_stride,
                      const int32_t *row_lens, const int64_t *tok_idx, const int64_t *seq_idx,
                      int64_t n, float scale, float *out, int64_t out_row_stride);

/* The model: sizes and, per layer, pointers to packed weights (csrc/gemm.c panels), biases
 * (NULL when absent), norm weights and the layer's KV cache [2, num_blocks, block_size,
 * num_kv_heads, head_dim]. Field order matches kernels/cpu_native.py's ctypes mirror. */
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
} kp_decoder_step;

/* 0 on success; -1 a position outside the rotary table, -2 a KV slot outside the cache,
 * -3 attention shape outside the kernel's limits, -4 a GEMM refused its arguments, -5 the
 * attention's scratch could not be allocated. */
int kp_decoder_stack_f32(const kp_decoder_stack *m, const kp_decoder_step *s) {
    const int64_t T = s->tokens, H = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t num_slots = m->num_blocks * m->block_size;
    const int64_t gu_width = 2 * ((m->inter + 47) / 48) * 48;  /* gate/up panel pairs */
    if (T <= 0) return 0;
    for (int64_t l = 0; l < m->layers; ++l) {
        /* Input norm; from the second layer on, the residual add of the last layer's MLP. */
        kp_add_rms_norm_f32(s->x, H, l ? s->residual : 0, m->in_norm[l], s->normed, T, H, m->eps);
        if (l == 0)  /* the first residual is the embedding itself */
            memcpy(s->residual, s->x, (size_t)(T * H) * sizeof(float));
        if (kp_gemm_f32(s->normed, H, T, m->qkv_w[l], H, qkv_size, m->qkv_b[l], s->qkv, qkv_size))
            return -4;
        if (kp_rope_f32(s->qkv, qkv_size, s->positions, m->cos_table, m->sin_table,
                        m->max_positions, T, m->heads + m->kv_heads, hd))
            return -1;
        if (kp_store_kv_f32(s->qkv + q_size, qkv_size, s->qkv + q_size + kv_size, qkv_size,
                            s->slots, T, m->kv[l], num_slots, kv_size))
            return -2;
        const int rc = kp_paged_rows_f32(
            s->qkv, qkv_size, m->kv[l], m->num_blocks, (int32_t)m->block_size,
            (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->heads, s->block_tables, s->bt_stride,
            s->row_lens, s->tok_idx, s->seq_idx, T, m->scale, s->attn, q_size);
        if (rc) return rc == -2 ? -5 : -3;
        if (kp_gemm_f32(s->attn, q_size, T, m->o_w[l], q_size, H, m->o_b[l], s->x, H))
            return -4;
        kp_add_rms_norm_f32(s->x, H, s->residual, m->post_norm[l], s->normed, T, H, m->eps);
        if (kp_gemm_silu_f32(s->normed, H, T, m->gate_up_w[l], H, m->inter, m->gate_up_b[l],
                             s->gate_up, gu_width, s->act, m->inter))
            return -4;
        if (kp_gemm_f32(s->act, m->inter, T, m->down_w[l], m->inter, H, m->down_b[l], s->x, H))
            return -4;
    }
    kp_add_rms_norm_f32(s->x, H, s->residual, m->final_norm, s->out, T, H, m->eps);
    return 0;
}
