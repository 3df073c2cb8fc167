/* A whole stack of decoder layers (Llama family: RMSNorm, fused qkv, Qwen3's per-head q/k norm
 * where present, RoPE, paged attention with the layer's sliding window, output projection,
 * RMSNorm, fused gate/up with SiLU, down projection; in fp32 also Gemma's: a norm after the
 * attention and after the MLP, GELU, soft-capped scores, a rotary table per layer) in one call,
 * on CPU, out of the other kernels of this library.
 *
 * Why: the same kernels called layer by layer from Python pay for Python and dispatch on every
 * call (module calls, argument checks, tensor allocation: about ten calls a layer), a large
 * share of a small decode step. Here a step makes one call; the order of operations is the
 * per-layer path's, so the results are the same bit for bit (tests/kernels/
 * test_decoder_stack.py).
 *
 * The caller owns every buffer (activations for T rows, the attention rows' metadata) and
 * checks shapes; this file only runs the sequence and reports out-of-range positions or slots.
 * The gate/up weight comes as panel pairs (kp_gemm_silu_f32), as the MLP module packs it. A
 * weight-only quantized projection (m->qbits) runs kp_quant_gemm_f32 instead; its gate/up is
 * one fused weight, followed by kp_silu_mul_f32, as the per-layer modules do. A quantized KV
 * cache (m->kv_format) takes the store and attention of kv_q8.c / paged_q8.c. The kernels
 * run as team bodies (kp_team.h) in one OpenMP region per layer (regions_f32), where the step
 * allows it.
 */
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kp_bf16.h"
#include "kp_native.h"
#include "kp_team.h"

enum { QKV, O, GATE_UP, DOWN };

/* y = x W^T (+ b) for projection j of layer l, in its format; nonzero: refused. */
static int project(const kp_decoder_stack *m, int64_t l, int j, const float *x, int64_t ldx,
                   int64_t T, const void *w, int64_t K, int64_t N, const float *b, float *y,
                   int64_t ldy) {
    const int32_t bits = m->qbits ? m->qbits[4 * l + j] : 0;
    if (!bits) return kp_gemm_f32(x, ldx, T, (const float *)w, K, N, b, y, ldy);
    return kp_quant_gemm_f32(x, ldx, T, (const uint8_t *)w, bits, m->qgroup[4 * l + j], K, N, b,
                             y, ldy);
}

/* Layer l's rotary tables: its own (Gemma 3's local layers) or the model's. */
static const float *cos_of(const kp_decoder_stack *m, int64_t l) {
    return m->layer_cos ? m->layer_cos[l] : m->cos_table;
}

static const float *sin_of(const kp_decoder_stack *m, int64_t l) {
    return m->layer_sin ? m->layer_sin[l] : m->sin_table;
}

/* Layer l's slots and block tables: its KV group's, or the step's one set. */
static const int64_t *slots_of(const kp_decoder_step *s, int64_t l) {
    return s->layer_slots ? s->layer_slots[l] : s->slots;
}

static const int32_t *tables_of(const kp_decoder_step *s, int64_t l) {
    return s->layer_tables ? s->layer_tables[l] : s->block_tables;
}

static int64_t bt_stride_of(const kp_decoder_step *s, int64_t l) {
    return s->layer_bt_stride ? s->layer_bt_stride[l] : s->bt_stride;
}

/* Layer l's KV store and attention over s->qkv into s->attn, float or quantized cache (the
 * per-layer modules' kernels for each); the stack's return codes. A float cache's store is
 * skipped when `stored` (the layer's region made it). */
static int attention(const kp_decoder_stack *m, const kp_decoder_step *s, int64_t l,
                     int64_t qkv_size, int64_t q_size, int64_t kv_size, int64_t num_slots,
                     int stored) {
    const int64_t T = s->tokens, hd = m->head_dim;
    const float *k = s->qkv + q_size, *v = s->qkv + q_size + kv_size;
    const int32_t window = m->window ? m->window[l] : 0;
    int rc;
    if (m->kv_format) {
        rc = kp_store_kv_q8(k, qkv_size, v, qkv_size, slots_of(s, l), T, (uint8_t *)m->kv[l],
                            m->kv_scales[l], m->num_blocks, (int32_t)m->block_size,
                            (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->kv_format);
        if (rc) return rc == -2 ? -5 : -2;
        rc = kp_paged_rows_q8(s->qkv, qkv_size, (const uint8_t *)m->kv[l], m->kv_scales[l],
                              (int32_t)m->kv_format, m->num_blocks, (int32_t)m->block_size,
                              (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->heads,
                              tables_of(s, l), bt_stride_of(s, l), s->row_lens, s->tok_idx,
                              s->seq_idx,
                              T, m->scale, window, m->softcap, s->attn, q_size);
    } else {
        if (!stored &&
            kp_store_kv_f32(k, qkv_size, v, qkv_size, slots_of(s, l), T, m->kv[l], num_slots,
                            kv_size))
            return -2;
        rc = kp_paged_rows_f32(s->qkv, qkv_size, m->kv[l], m->num_blocks, (int32_t)m->block_size,
                               (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->heads,
                               tables_of(s, l), bt_stride_of(s, l), s->row_lens, s->tok_idx,
                               s->seq_idx, T, m->scale, window, m->softcap, s->attn, q_size);
    }
    return rc == 0 ? 0 : rc == -2 ? -5 : -3;
}

/* Every position and every layer's slot of the step in range: the team bodies do not check
 * them. */
static int step_in_range(const kp_decoder_stack *m, const kp_decoder_step *s) {
    const int64_t num_slots = m->num_blocks * m->block_size;
    for (int64_t t = 0; t < s->tokens; ++t)
        if (s->positions[t] < 0 || s->positions[t] >= m->max_positions)
            return 0;
    for (int64_t l = 0; l < (s->layer_slots ? m->layers : 1); ++l) {
        const int64_t *slots = slots_of(s, l);
        for (int64_t t = 0; t < s->tokens; ++t)
            if (slots[t] >= num_slots) return 0;
    }
    return 1;
}

/* Whether every projection's format is one its kernel takes: a quantized one's group a valid
 * one dividing K (and even in bf16); a plain bf16 one's K even (pairs). */
static int formats_ok(const kp_decoder_stack *m, int bf16) {
    const int64_t K[4] = {m->hidden, m->heads * m->head_dim, m->hidden, m->inter};
    for (int64_t l = 0; l < m->layers; ++l)
        for (int j = 0; j < 4; ++j) {
            const int32_t bits = m->qbits ? m->qbits[4 * l + j] : 0;
            const int64_t g = bits ? m->qgroup[4 * l + j] : 0;
            if (bits ? kp_quant_block_bytes(bits, g) < 0 || K[j] % g || (bf16 && g % 2) ||
                           (j == GATE_UP && m->gelu)  /* no GELU after a quantized gate/up */
                     : bf16 && K[j] % 2)
                return 0;
        }
    return 1;
}

/* Whether regions_f32 takes this step: positions and slots in range, every quantized
 * projection's format one kp_quant_gemm_f32 takes, and nested regions inactive (team_gemm_f32
 * calls kp_gemm_f32 inside the stack's region, where its own region must be one thread).
 * Otherwise the kernel-by-kernel loop runs, which returns the error where there is one. */
static int team_ok(const kp_decoder_stack *m, const kp_decoder_step *s) {
#ifdef _OPENMP
    /* omp_get_nested: deprecated in OpenMP 5, but the one query both libgomps answer right
     * (torch's older one reports unlimited active levels with nesting off) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    if (omp_get_nested()) return 0;
#pragma GCC diagnostic pop
#endif
    return formats_ok(m, 0) && step_in_range(m, s);
}

/* This thread's share [*p0, *p1) of n items, contiguous, as a static schedule cuts them. */
static void team_share(int64_t n, int64_t *p0, int64_t *p1) {
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    *p0 = n * t / nt;
    *p1 = n * (t + 1) / nt;
}

/* kp_gemm_f32 as a team body: each thread runs it over its share of the panels (inside the
 * stack's region its own region is one thread), then the team meets. A panel's outputs come
 * from the same panel pass over the same rows whoever computes them, so the bits are the
 * kernel's. (gemm.c has no team body of its own; its home is there.) */
static void team_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                          int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t NR = KP_GEMM_PANEL;
    int64_t p0, p1;
    team_share((N + NR - 1) / NR, &p0, &p1);
    const int64_t n1 = p1 * NR < N ? p1 * NR : N;
    if (p1 > p0)
        kp_gemm_f32(x, ldx, M, packed + p0 * K * NR, K, n1 - p0 * NR, bias ? bias + p0 * NR : 0,
                    y + p0 * NR, ldy);
#pragma omp barrier
}

/* kp_gemm_silu_f32 (kp_gemm_gelu_f32 with gelu) the same way, over its panel pairs. */
static void team_gemm_act_f32(const float *x, int64_t ldx, int64_t M, const float *packed,
                              int64_t K, int64_t inter, const float *bias, float *gu,
                              int64_t ldgu, float *act, int64_t ldact, int gelu) {
    const int64_t NR = KP_GEMM_PANEL;
    int64_t q0, q1;
    team_share((inter + NR - 1) / NR, &q0, &q1);
    const int64_t c1 = q1 * NR < inter ? q1 * NR : inter;
    if (q1 > q0)
        (gelu ? kp_gemm_gelu_f32 : kp_gemm_silu_f32)(
            x, ldx, M, packed + 2 * q0 * K * NR, K, c1 - q0 * NR, bias ? bias + 2 * q0 * NR : 0,
            gu + 2 * q0 * NR, ldgu, act + q0 * NR, ldact);
#pragma omp barrier
}

/* project() as a team body (its format checked by team_ok). */
static void team_project(const kp_decoder_stack *m, int64_t l, int j, const float *x,
                         int64_t ldx, int64_t T, const void *w, int64_t K, int64_t N,
                         const float *b, float *y, int64_t ldy) {
    const int32_t bits = m->qbits ? m->qbits[4 * l + j] : 0;
    if (!bits)
        team_gemm_f32(x, ldx, T, (const float *)w, K, N, b, y, ldy);
    else
        kp_team_quant_gemm_f32(x, ldx, T, (const uint8_t *)w, bits, m->qgroup[4 * l + j], K, N,
                               b, y, ldy);
}

/* kp_decoder_stack_f32's loop in one parallel region per layer: the same kernels as team
 * bodies, in the same order, each ending in its barrier. A region runs from the last layer's
 * attention output (its output projection and MLP) to the next layer's queries and keys (its
 * norm, qkv projection, q/k norm, RoPE and, for a float cache, the KV store in the same pass);
 * the attention between (paged_dispatch.c, or the quantized cache's store and attention) runs
 * in its own regions. Layers + 1 regions a step instead of 5-9 a layer. */
static int regions_f32(const kp_decoder_stack *m, const kp_decoder_step *s) {
    const int64_t T = s->tokens, H = m->hidden, hd = m->head_dim, inter = m->inter;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t num_slots = m->num_blocks * m->block_size;
    const int64_t gu_width = 2 * ((inter + KP_GEMM_PANEL - 1) / KP_GEMM_PANEL) * KP_GEMM_PANEL;
    float *x = s->x, *res = s->residual, *normed = s->normed, *qkv = s->qkv;
    for (int64_t l = 0; l <= m->layers; ++l) {
#pragma omp parallel
        {
            if (l > 0) {  /* layer l - 1 after its attention */
                const int64_t p = l - 1;
                team_project(m, p, O, s->attn, q_size, T, m->o_w[p], q_size, H, m->o_b[p], x, H);
                if (m->attn_out_norm)  /* Gemma: the attention output normed, in place */
                    kp_team_add_rms_norm_f32(x, H, 0, m->attn_out_norm[p], x, T, H, m->eps);
                kp_team_add_rms_norm_f32(x, H, res, m->post_norm[p], normed, T, H, m->eps);
                if (m->qbits && m->qbits[4 * p + GATE_UP]) {
                    team_project(m, p, GATE_UP, normed, H, T, m->gate_up_w[p], H, 2 * inter,
                                 m->gate_up_b[p], s->gate_up, 2 * inter);
                    kp_team_silu_mul_f32(s->gate_up, s->act, T, inter);
                } else {
                    team_gemm_act_f32(normed, H, T, m->gate_up_w[p], H, inter, m->gate_up_b[p],
                                      s->gate_up, gu_width, s->act, inter, m->gelu);
                }
                team_project(m, p, DOWN, s->act, inter, T, m->down_w[p], inter, H, m->down_b[p],
                             x, H);
                if (m->mlp_out_norm)  /* Gemma: the MLP output normed, in place */
                    kp_team_add_rms_norm_f32(x, H, 0, m->mlp_out_norm[p], x, T, H, m->eps);
            }
            if (l == 0) {  /* the first residual is the embedding itself (the norm reads x too) */
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < T; ++t)
                    memcpy(res + t * H, x + t * H, (size_t)H * sizeof(float));
            }
            if (l < m->layers) {  /* layer l up to its attention */
                kp_team_add_rms_norm_f32(x, H, l ? res : 0, m->in_norm[l], normed, T, H, m->eps);
                team_project(m, l, QKV, normed, H, T, m->qkv_w[l], H, qkv_size, m->qkv_b[l], qkv,
                             qkv_size);
                if (m->q_norm)
                    kp_team_qk_norm_f32(qkv, qkv_size, T, m->heads, m->kv_heads, hd,
                                        m->q_norm[l], m->k_norm[l], m->eps);
                kp_team_rope_store_f32(qkv, qkv_size, s->positions, cos_of(m, l), sin_of(m, l), T,
                                       m->heads + m->kv_heads, hd, slots_of(s, l),
                                       m->kv_format ? 0 : m->kv[l], num_slots, q_size,
                                       q_size + kv_size, kv_size);
            } else {
                kp_team_add_rms_norm_f32(x, H, res, m->final_norm, s->out, T, H, m->eps);
            }
        }
        if (l < m->layers) {
            const int rc = attention(m, s, l, qkv_size, q_size, kv_size, num_slots, 1);
            if (rc) return rc;
        }
    }
    return 0;
}

int kp_decoder_stack_f32(const kp_decoder_stack *m, const kp_decoder_step *s) {
    const int64_t T = s->tokens, H = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t num_slots = m->num_blocks * m->block_size;
    const int64_t gu_width =  /* gate/up panel pairs */
        2 * ((m->inter + KP_GEMM_PANEL - 1) / KP_GEMM_PANEL) * KP_GEMM_PANEL;
    if (T <= 0) return 0;
    if (team_ok(m, s)) return regions_f32(m, s);
    for (int64_t l = 0; l < m->layers; ++l) {
        /* Input norm; from the second layer on, the residual add of the last layer's MLP. */
        kp_add_rms_norm_f32(s->x, H, l ? s->residual : 0, m->in_norm[l], s->normed, T, H, m->eps);
        if (l == 0)  /* the first residual is the embedding itself */
            memcpy(s->residual, s->x, (size_t)(T * H) * sizeof(float));
        if (project(m, l, QKV, s->normed, H, T, m->qkv_w[l], H, qkv_size, m->qkv_b[l], s->qkv,
                    qkv_size))
            return -4;
        if (m->q_norm)
            kp_qk_norm_f32(s->qkv, qkv_size, T, m->heads, m->kv_heads, hd, m->q_norm[l],
                           m->k_norm[l], m->eps);
        if (kp_rope_f32(s->qkv, qkv_size, s->positions, cos_of(m, l), sin_of(m, l),
                        m->max_positions, T, m->heads + m->kv_heads, hd))
            return -1;
        const int rc = attention(m, s, l, qkv_size, q_size, kv_size, num_slots, 0);
        if (rc) return rc;
        if (project(m, l, O, s->attn, q_size, T, m->o_w[l], q_size, H, m->o_b[l], s->x, H))
            return -4;
        if (m->attn_out_norm)
            kp_add_rms_norm_f32(s->x, H, 0, m->attn_out_norm[l], s->x, T, H, m->eps);
        kp_add_rms_norm_f32(s->x, H, s->residual, m->post_norm[l], s->normed, T, H, m->eps);
        if (m->qbits && m->qbits[4 * l + GATE_UP]) {
            if (m->gelu) return -4;  /* no native GELU-and-multiply after a quantized gate/up */
            /* gate_up is [T, 2 inter] here, within the scratch's T x gu_width */
            if (project(m, l, GATE_UP, s->normed, H, T, m->gate_up_w[l], H, 2 * m->inter,
                        m->gate_up_b[l], s->gate_up, 2 * m->inter))
                return -4;
            kp_silu_mul_f32(s->gate_up, s->act, T, m->inter);
        } else if ((m->gelu ? kp_gemm_gelu_f32 : kp_gemm_silu_f32)(
                       s->normed, H, T, m->gate_up_w[l], H, m->inter, m->gate_up_b[l],
                       s->gate_up, gu_width, s->act, m->inter)) {
            return -4;
        }
        if (project(m, l, DOWN, s->act, m->inter, T, m->down_w[l], m->inter, H, m->down_b[l],
                    s->x, H))
            return -4;
        if (m->mlp_out_norm)
            kp_add_rms_norm_f32(s->x, H, 0, m->mlp_out_norm[l], s->x, T, H, m->eps);
    }
    kp_add_rms_norm_f32(s->x, H, s->residual, m->final_norm, s->out, T, H, m->eps);
    return 0;
}

/* Layer l's store and attention in the bf16 stack over a quantized cache, as the per-layer
 * modules do it (kernels/kserve_paged_kernels/cpu_kvq.py): q, k and v widened to fp32 (exact), the fp32 kernels of
 * attention(), the output rounded to bf16 once. */
static int attention_q8_bf16(const kp_decoder_stack *m, const kp_decoder_step *s, int64_t l,
                             int64_t qkv_size, int64_t q_size, int64_t kv_size) {
    const int64_t T = s->tokens;
    float *f = malloc((size_t)(T * (qkv_size + q_size)) * sizeof(float));
    if (!f) return -5;
    const uint16_t *qkv = (const uint16_t *)s->qkv;
    for (int64_t i = 0; i < T * qkv_size; ++i) f[i] = bf16_to_f32(qkv[i]);
    kp_decoder_step fs = *s;
    fs.qkv = f;
    fs.attn = f + T * qkv_size;
    const int rc = attention(m, &fs, l, qkv_size, q_size, kv_size, 0, 0);
    uint16_t *attn = (uint16_t *)s->attn;
    for (int64_t i = 0; i < T * q_size && !rc; ++i) attn[i] = f32_to_bf16(fs.attn[i]);
    free(f);
    return rc;
}

/* The same stack over bf16 (kp_decoder_stack_bf16, kp_native.h): the per-layer modules' bf16
 * path kernel for kernel (kp_add_rms_norm_bf16, kp_gemm_bf16, kp_rope_bf16, kp_store_kv_bf16,
 * kp_paged_rows_bf16, kp_silu_mul_bf16), so the results are theirs bit for bit. Every pointer
 * of the structs holds bf16 values except the weights (bf16 pairs, gemm_bf16.c) and the
 * integer metadata; gate/up is one plain pair-packed [2 * inter, hidden] weight whose output
 * goes to s->gate_up ([T, 2 * inter]) before the SiLU-and-multiply. A weight-only quantized
 * projection (m->qbits, as in the fp32 stack; gate/up then the same plain fused weight) runs
 * kp_quant_gemm_bf16, as the per-layer modules do. No q/k norm (the caller declines Qwen3
 * here). */
static int project_bf16(const kp_decoder_stack *m, int64_t l, int j, const uint16_t *x,
                        int64_t ldx, int64_t T, const void *w, int64_t K, int64_t N,
                        const void *b, uint16_t *y, int64_t ldy) {
    const int32_t bits = m->qbits ? m->qbits[4 * l + j] : 0;
    if (!bits)
        return kp_gemm_bf16(x, ldx, T, (const uint32_t *)w, K, N, (const uint16_t *)b, y, ldy);
    return kp_quant_gemm_bf16(x, ldx, T, (const uint8_t *)w, bits, m->qgroup[4 * l + j], K, N,
                              (const uint16_t *)b, y, ldy);
}

/* Whether one_region_bf16 takes this step: a bf16 cache, no sliding window, every
 * projection's format and the attention's shapes ones its kernels take, every position and
 * slot in range. Otherwise the
 * kernel-by-kernel loop below runs, which returns the error where there is one. */
static int one_region_ok(const kp_decoder_stack *m, const kp_decoder_step *s) {
    if (m->kv_format) return 0;
    for (int64_t l = 0; l < m->layers; ++l)
        if ((m->window && m->window[l]) ||
            !kp_team_attention_ok((int32_t)m->block_size, (int32_t)m->kv_heads,
                                  (int32_t)m->head_dim, (int32_t)m->heads, 0, 0.0f))
            return 0;
    return formats_ok(m, 1) && step_in_range(m, s);
}

/* project_bf16 as a team body (kp_team.h): the format is checked. */
static void team_project_bf16(const kp_decoder_stack *m, int64_t l, int j, const uint16_t *x,
                              int64_t ldx, int64_t T, const void *w, int64_t K, int64_t N,
                              const void *b, uint16_t *y, int64_t ldy) {
    const int32_t bits = m->qbits ? m->qbits[4 * l + j] : 0;
    if (!bits)
        kp_team_gemm_bf16(x, ldx, T, (const uint32_t *)w, K, N, (const uint16_t *)b, y, ldy);
    else
        kp_team_quant_gemm_bf16(x, ldx, T, (const uint8_t *)w, bits, m->qgroup[4 * l + j], K, N,
                                (const uint16_t *)b, y, ldy);
}

/* kp_decoder_stack_bf16's loop in one parallel region: the same kernels as team bodies, in the
 * same order, each ending in its barrier (the next one reads whole rows of what the last one
 * wrote by columns, or the reverse), RoPE and the KV store one pass over the rows, the
 * attention's plan (the prefill runs among the rows) made once for all layers. */
static int one_region_bf16(const kp_decoder_stack *m, const kp_decoder_step *s) {
    typedef uint16_t bf;
    const int64_t T = s->tokens, H = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->inter;
    const int64_t num_slots = m->num_blocks * m->block_size;
    bf *x = (bf *)s->x, *res = (bf *)s->residual, *normed = (bf *)s->normed;
    bf *qkv = (bf *)s->qkv, *attn = (bf *)s->attn, *gu = (bf *)s->gate_up, *act = (bf *)s->act;
    kp_team_attention sh;
    kp_team_attention_plan(&sh, (int32_t)m->block_size, (int32_t)hd, (int32_t)m->kv_heads,
                           s->block_tables, s->bt_stride, s->row_lens, s->seq_idx, T, 0, 0.0f);
#pragma omp parallel
    {
        for (int64_t l = 0; l < m->layers; ++l) {
            if (l == 0) {  /* the first residual is the embedding itself (the norm reads x too) */
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < T; ++t)
                    memcpy(res + t * H, x + t * H, (size_t)H * sizeof(bf));
            }
            kp_team_add_rms_norm_bf16(x, H, l ? res : 0, (const bf *)m->in_norm[l], normed, T, H,
                                      m->eps);
            team_project_bf16(m, l, QKV, normed, H, T, m->qkv_w[l], H, qkv_size, m->qkv_b[l], qkv,
                              qkv_size);
            kp_team_rope_store_bf16(qkv, qkv_size, s->positions, (const bf *)m->cos_table,
                                    (const bf *)m->sin_table, T, m->heads + m->kv_heads, hd,
                                    s->slots, (bf *)m->kv[l], num_slots, q_size,
                                    q_size + kv_size, kv_size);
            kp_team_paged_rows_bf16(
                qkv, qkv_size, (const bf *)m->kv[l], m->num_blocks, (int32_t)m->block_size,
                (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->heads, s->block_tables,
                s->bt_stride, s->row_lens, s->tok_idx, s->seq_idx, T, m->scale,
                0, 0.0f, attn, q_size, &sh);
            if (sh.failed) break;  /* read after the loop's barrier: the same for every thread */
            team_project_bf16(m, l, O, attn, q_size, T, m->o_w[l], q_size, H, m->o_b[l], x, H);
            kp_team_add_rms_norm_bf16(x, H, res, (const bf *)m->post_norm[l], normed, T, H,
                                      m->eps);
            team_project_bf16(m, l, GATE_UP, normed, H, T, m->gate_up_w[l], H, 2 * inter,
                              m->gate_up_b[l], gu, 2 * inter);
            kp_team_silu_mul_bf16(gu, act, T, inter);
            team_project_bf16(m, l, DOWN, act, inter, T, m->down_w[l], inter, H, m->down_b[l], x,
                              H);
        }
        if (!sh.failed)
            kp_team_add_rms_norm_bf16(x, H, res, (const bf *)m->final_norm, (bf *)s->out, T, H,
                                      m->eps);
    }
    kp_team_attention_free(&sh);
    return sh.failed ? -5 : 0;
}

int kp_decoder_stack_bf16(const kp_decoder_stack *m, const kp_decoder_step *s) {
    typedef uint16_t bf;
    const int64_t T = s->tokens, H = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->inter;
    const int64_t num_slots = m->num_blocks * m->block_size;
    bf *x = (bf *)s->x, *res = (bf *)s->residual, *normed = (bf *)s->normed;
    bf *qkv = (bf *)s->qkv, *attn = (bf *)s->attn, *gu = (bf *)s->gate_up, *act = (bf *)s->act;
    if (T <= 0) return 0;
    if (m->q_norm || m->attn_out_norm || m->mlp_out_norm || m->layer_cos || m->softcap != 0.0f ||
        m->gelu || s->layer_slots || s->layer_tables || s->layer_bt_stride)
        return -4;
    if (one_region_ok(m, s)) return one_region_bf16(m, s);
    for (int64_t l = 0; l < m->layers; ++l) {
        kp_add_rms_norm_bf16(x, H, l ? res : 0, (const bf *)m->in_norm[l], normed, T, H, m->eps);
        if (l == 0) memcpy(res, x, (size_t)(T * H) * sizeof(bf));
        if (project_bf16(m, l, QKV, normed, H, T, m->qkv_w[l], H, qkv_size, m->qkv_b[l], qkv,
                         qkv_size))
            return -4;
        if (kp_rope_bf16(qkv, qkv_size, s->positions, (const bf *)m->cos_table,
                         (const bf *)m->sin_table, m->max_positions, T, m->heads + m->kv_heads, hd))
            return -1;
        if (m->kv_format) {
            const int rc = attention_q8_bf16(m, s, l, qkv_size, q_size, kv_size);
            if (rc) return rc;
        } else if (kp_store_kv_bf16(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size,
                                    s->slots, T, (bf *)m->kv[l], num_slots, kv_size)) {
            return -2;
        }
        const int rc = m->kv_format ? 0 : kp_paged_rows_bf16(
            qkv, qkv_size, (const bf *)m->kv[l], m->num_blocks, (int32_t)m->block_size,
            (int32_t)m->kv_heads, (int32_t)hd, (int32_t)m->heads, s->block_tables, s->bt_stride,
            s->row_lens, s->tok_idx, s->seq_idx, T, m->scale, m->window ? m->window[l] : 0, 0.0f,
            attn, q_size);
        if (rc) return rc == -2 ? -5 : -3;
        if (project_bf16(m, l, O, attn, q_size, T, m->o_w[l], q_size, H, m->o_b[l], x, H))
            return -4;
        kp_add_rms_norm_bf16(x, H, res, (const bf *)m->post_norm[l], normed, T, H, m->eps);
        if (project_bf16(m, l, GATE_UP, normed, H, T, m->gate_up_w[l], H, 2 * inter,
                         m->gate_up_b[l], gu, 2 * inter))
            return -4;
        kp_silu_mul_bf16(gu, act, T, inter);
        if (project_bf16(m, l, DOWN, act, inter, T, m->down_w[l], inter, H, m->down_b[l], x, H))
            return -4;
    }
    kp_add_rms_norm_bf16(x, H, res, (const bf *)m->final_norm, (bf *)s->out, T, H, m->eps);
    return 0;
}
