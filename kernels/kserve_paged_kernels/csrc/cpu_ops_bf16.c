/* Fused elementwise ops of a Llama layer on CPU over bf16 activations: residual add + RMSNorm,
 * RoPE in place, SiLU-and-multiply and the KV store (kp_native.h). In PyTorch each is 3-8 passes over the
 * activations with a dtype conversion in most of them (a bf16 profile had them at ~15% of a
 * step); here one pass each, in fp32 registers.
 *
 * Rounding is where transformers rounds in bf16, so the result is the eager layer's up to the
 * order of the fp32 sum of squares: the residual sum is rounded to bf16 (and stored), the mean
 * of squares is taken in fp32, the normed value is rounded before the weight multiply and the
 * product rounded again; each RoPE product and sum is rounded; SiLU's result is rounded
 * before the multiply by `up`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kp_bf16.h"
#include "kp_native.h"
#include "kp_team.h"

#define PAR_MIN_ROWS 32

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

void kp_team_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                               const uint16_t *w, uint16_t *out, int64_t rows, int64_t hidden,
                               float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *xr = x + t * x_stride;
        if (residual) {
            uint16_t *r = residual + t * hidden;
            for (int64_t i = 0; i < hidden; ++i)
                r[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(r[i]));
            xr = r;
        }
        vf acc = vzero();
        int64_t i = 0;
        for (; i + KP_VW <= hidden; i += KP_VW) {
            const vf v = vload_bf16(xr + i);
            acc = vfma(v, v, acc);
        }
        float ss = vhsum(acc);
        for (; i < hidden; ++i) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        uint16_t *o = out + t * hidden;
        for (i = 0; i < hidden; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * rbf(bf16_to_f32(xr[i]) * inv));
    }
}

void kp_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                          const uint16_t *w, uint16_t *out, int64_t rows, int64_t hidden,
                          float eps) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_add_rms_norm_bf16(x, x_stride, residual, w, out, rows, hidden, eps);
}

void kp_team_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *g = gu + t * 2 * inter, *u = g + inter;
        uint16_t *o = out + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(rbf(x / (1.0f + expf(-x))) * bf16_to_f32(u[i]));
        }
    }
}

void kp_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_silu_mul_bf16(gu, out, rows, inter);
}

int kp_store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                     const int64_t *slots, int64_t n, uint16_t *cache, int64_t num_slots,
                     int64_t row_elems) {
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= num_slots) return -1;
    uint16_t *vc = cache + num_slots * row_elems;
    for (int64_t t = 0; t < n; ++t) {
        if (slots[t] < 0) continue;
        memcpy(cache + slots[t] * row_elems, k + t * k_stride, (size_t)row_elems * 2);
        memcpy(vc + slots[t] * row_elems, v + t * v_stride, (size_t)row_elems * 2);
    }
    return 0;
}

/* Rotary embedding in place over bf16 rows with a bf16 table, each product and each sum
 * rounded to bf16 as eager bf16 (transformers' rotate-half) rounds them; with a cache, the
 * row's k and v then stored (kp_team.h). */
void kp_team_rope_store_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions,
                             const uint16_t *cos_table, const uint16_t *sin_table, int64_t rows,
                             int64_t heads, int64_t head_dim, const int64_t *slots,
                             uint16_t *cache, int64_t num_slots, int64_t k_off, int64_t v_off,
                             int64_t row_elems) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *c = cos_table + positions[t] * half;
        const uint16_t *s = sin_table + positions[t] * half;
        uint16_t *row = x + t * row_stride;
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t *x1 = row + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                const float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                x1[i] = f32_to_bf16(rbf(a * ci) - rbf(b * si));
                x2[i] = f32_to_bf16(rbf(b * ci) + rbf(a * si));
            }
        }
        if (cache && slots[t] >= 0) {
            memcpy(cache + slots[t] * row_elems, row + k_off, (size_t)row_elems * 2);
            memcpy(cache + (num_slots + slots[t]) * row_elems, row + v_off,
                   (size_t)row_elems * 2);
        }
    }
}

int kp_rope_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions,
                 const uint16_t *cos_table, const uint16_t *sin_table, int64_t max_positions,
                 int64_t rows, int64_t heads, int64_t head_dim) {
    for (int64_t t = 0; t < rows; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_rope_store_bf16(x, row_stride, positions, cos_table, sin_table, rows, heads,
                            head_dim, 0, 0, 0, 0, 0, 0);
    return 0;
}
