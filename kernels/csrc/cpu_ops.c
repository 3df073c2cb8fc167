/* Fused elementwise ops of a Llama layer on CPU, fp32: residual add + RMSNorm, rotary embedding
 * in place, SiLU-and-multiply, and the KV store. Each PyTorch version of these is 3-8 separate
 * passes over the activations (and strided ones for RoPE's half-rotations), or for the store a
 * handful of small ops with their dispatch cost; each of these is one pass.
 *
 * Rows are spread over OpenMP threads when there are enough of them to pay for the fork.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAR_MIN_ROWS 32

/* out[t] = w * normalize(x[t] (+ residual[t])); with a residual, residual[t] becomes the sum.
 * The mean of squares is accumulated in float, as transformers does in float32. */
void kp_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w,
                         float *out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows >= PAR_MIN_ROWS)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * x_stride;
        float *o = out + t * hidden;
        float ss = 0.0f;
        if (residual) {
            float *r = residual + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) {
                const float s = xr[i] + r[i];
                r[i] = s;
                ss += s * s;
            }
            const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
            for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (r[i] * inv);
        } else {
            for (int64_t i = 0; i < hidden; ++i) ss += xr[i] * xr[i];
            const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
            for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (xr[i] * inv);
        }
    }
}

/* Rotate, in place, the first `heads` heads of each row (rotate-half layout): for each head,
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with the angles of the row's position. The
 * q and k heads sit next to each other at the start of a fused qkv row, so one call does both. */
int kp_rope_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
                const float *sin_table, int64_t max_positions, int64_t rows, int64_t heads,
                int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < rows; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
#pragma omp parallel for schedule(static) if (rows >= PAR_MIN_ROWS)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        float *row = x + t * row_stride;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = row + h * head_dim;
            float *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i] for the fused gate/up projection's output. */
void kp_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= PAR_MIN_ROWS / 4)
    for (int64_t t = 0; t < rows; ++t) {
        const float *g = gu + t * 2 * inter;
        const float *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* KV store: row t of k and v (row_floats contiguous floats each, rows k_stride / v_stride
 * apart) goes to slot slots[t] of the K and V halves of a [2, num_slots, row_floats] cache;
 * negative slots are skipped. Returns -1, writing nothing, if a slot is out of range. */
int kp_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *slots, int64_t n, float *cache, int64_t num_slots,
                    int64_t row_floats) {
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= num_slots) return -1;
    float *kc = cache, *vc = cache + num_slots * row_floats;
    for (int64_t t = 0; t < n; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        memcpy(kc + s * row_floats, k + t * k_stride, (size_t)row_floats * sizeof(float));
        memcpy(vc + s * row_floats, v + t * v_stride, (size_t)row_floats * sizeof(float));
    }
    return 0;
}
