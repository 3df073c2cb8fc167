/* Fused elementwise ops of a Llama layer on CPU, fp32: residual add + RMSNorm, the per-head q/k
 * norm and rotary embedding in place, SiLU-and-multiply, and the KV store. Each PyTorch version of these is 3-8 separate
 * passes over the activations (and strided ones for RoPE's half-rotations), or for the store a
 * handful of small ops with their dispatch cost; each of these is one pass.
 *
 * Rows are spread over OpenMP threads when there are enough of them to pay for the fork. The
 * row loops are team bodies (kp_team.h), so the fp32 decoder stack runs them in its own region.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kp_native.h"
#include "kp_team.h"
#include "kp_vec.h"

#define PAR_MIN_ROWS 32

/* Sum of squares of n floats in a fixed order (lane sums, then across lanes, then the tail),
 * whatever the address: the decoder stack and the per-layer modules norm the same values in
 * different buffers and must agree bit for bit. */
static inline float sum_squares(const float *x, int64_t n) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + KP_VW <= n; i += KP_VW) {
        const vf v = vload(x + i);
        acc = vfma(v, v, acc);
    }
    float ss = vhsum(acc);
    for (; i < n; ++i) ss += x[i] * x[i];
    return ss;
}

/* o = w * (x * rsqrt(mean(x^2) + eps)) for one row (o may be x). */
static inline void rms_norm_row(const float *x, const float *w, float *o, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (x[i] * inv);
}

/* out[t] = w * normalize(x[t] (+ residual[t])); with a residual, residual[t] becomes the sum.
 * The mean of squares is accumulated in float, as transformers does in float32. */
void kp_team_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w,
                              float *out, int64_t rows, int64_t hidden, float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * x_stride;
        if (residual) {
            float *r = residual + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) r[i] += xr[i];
            xr = r;
        }
        rms_norm_row(xr, w, out + t * hidden, hidden, eps);
    }
}

void kp_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *w,
                         float *out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_add_rms_norm_f32(x, x_stride, residual, w, out, rows, hidden, eps);
}

/* Qwen3's q/k norm: an RMSNorm over each head, in place on fused qkv rows, the first q_heads
 * heads with q_w, the next k_heads with k_w (each [head_dim]). */
void kp_team_qk_norm_f32(float *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                         int64_t k_heads, int64_t head_dim, const float *q_w, const float *k_w,
                         float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t h = 0; h < q_heads + k_heads; ++h) {
            float *hx = x + t * row_stride + h * head_dim;
            rms_norm_row(hx, h < q_heads ? q_w : k_w, hx, head_dim, eps);
        }
}

void kp_qk_norm_f32(float *x, int64_t row_stride, int64_t rows, int64_t q_heads, int64_t k_heads,
                    int64_t head_dim, const float *q_w, const float *k_w, float eps) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_qk_norm_f32(x, row_stride, rows, q_heads, k_heads, head_dim, q_w, k_w, eps);
}

/* Rotate, in place, the first `heads` heads of each row (rotate-half layout): for each head,
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with the angles of the row's position. The
 * q and k heads sit next to each other at the start of a fused qkv row, so one call does both.
 * With a cache, the row's k and v then go to its slot as kp_store_kv_f32 stores them (kp_team.h). */
void kp_team_rope_store_f32(float *x, int64_t row_stride, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t rows,
                            int64_t heads, int64_t head_dim, const int64_t *slots, float *cache,
                            int64_t num_slots, int64_t k_off, int64_t v_off,
                            int64_t row_floats) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static)
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
        if (cache && slots[t] >= 0) {
            memcpy(cache + slots[t] * row_floats, row + k_off, (size_t)row_floats * sizeof(float));
            memcpy(cache + (num_slots + slots[t]) * row_floats, row + v_off,
                   (size_t)row_floats * sizeof(float));
        }
    }
}

int kp_rope_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
                const float *sin_table, int64_t max_positions, int64_t rows, int64_t heads,
                int64_t head_dim) {
    for (int64_t t = 0; t < rows; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_rope_store_f32(x, row_stride, positions, cos_table, sin_table, rows, heads, head_dim,
                           0, 0, 0, 0, 0, 0);
    return 0;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i] for the fused gate/up projection's output. */
void kp_team_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *g = gu + t * 2 * inter;
        const float *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void kp_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS / 4)
    kp_team_silu_mul_f32(gu, out, rows, inter);
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

/* One memcpy per block, layer and K/V half, on the calling thread: a handful of blocks per
 * step after a fork, too little to pay for waking a parallel region (BENCHMARKS.md). */
int kp_copy_blocks(void *const *caches, int64_t layers, int64_t num_blocks, int64_t block_bytes,
                   const int64_t *src, const int64_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (src[i] < 0 || src[i] >= num_blocks || dst[i] < 0 || dst[i] >= num_blocks) return -1;
    const int64_t half = num_blocks * block_bytes;
    for (int64_t l = 0; l < layers; ++l) {
        char *base = (char *)caches[l];
        for (int64_t kv = 0; kv < 2; ++kv)
            for (int64_t i = 0; i < n; ++i)
                memcpy(base + kv * half + dst[i] * block_bytes,
                       base + kv * half + src[i] * block_bytes, (size_t)block_bytes);
    }
    return 0;
}

/* out[r] = index of the largest value of row r, the first one on ties, the first NaN if the row
 * has one (torch.argmax's rules). Greedy decoding's last step, in one vector pass, several times
 * faster than torch's argmax over a large vocabulary (BENCHMARKS.md). */
/* NaN test on the bits: the library is built with -ffast-math, under which x != x folds away. */
static inline int is_nan(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

static int64_t argmax_row(const float *x, int64_t n) {
    vf best = vset1(-INFINITY);
    vi best_idx = viota() * 0, idx = viota(), nan = best_idx;  /* zeros, 0 .. KP_VW - 1, zeros */
    for (int64_t i = 0; i < n; i += KP_VW) {
        const int left = (n - i) >= KP_VW ? KP_VW : (int)(n - i);
        const vf v = left == KP_VW ? vload(x + i)
                                   : vselect(vlanes_below(left), vload_n(x + i, left), vset1(-INFINITY));
        nan |= ((vi)v & 0x7FFFFFFF) > 0x7F800000;  /* on the bits: -ffast-math drops v != v */
        const vi gt = v > best;  /* strict: the first of equal values wins */
        best = vselect(gt, v, best);
        best_idx = (best_idx & ~gt) | (idx & gt);
        idx += KP_VW;
    }
    for (int l = 0; l < KP_VW; ++l) {
        if (nan[l]) {
            for (int64_t i = 0; i < n; ++i)
                if (is_nan(x[i])) return i;
        }
    }
    const float top = vhmax(best);
    int64_t arg = n;
    for (int l = 0; l < KP_VW; ++l)
        if (best[l] == top && best_idx[l] < arg) arg = best_idx[l];
    return arg;
}

void kp_argmax_rows_f32(const float *x, int64_t row_stride, int64_t rows, int64_t cols,
                        int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, cols);
}
