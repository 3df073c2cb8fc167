/* Gemma's elementwise ops over bf16 activations (kp_native.h): its RMSNorm times (1 + w) with
 * the residual add, the per-head q/k norm in place on fused qkv rows (Gemma 3), and GeGLU's
 * tanh-GELU-and-multiply. One pass each in fp32 registers, where PyTorch takes 3-8 passes
 * with a dtype conversion in most.
 *
 * Rounding is where transformers' Gemma rounds in bf16, which is not Llama's order
 * (cpu_ops_bf16.c): the residual sum is rounded to bf16 (and stored), the row is normalised
 * and multiplied by (1 + w) in fp32 (the caller keeps 1 + w in fp32) and rounded once; GELU's
 * result is rounded before the multiply by `up`, and the product rounded again. So the results
 * are the eager layer's up to the order of the fp32 sum of squares and the last fp32 bits of
 * rsqrt and tanh.
 */
#include <math.h>
#include <stdint.h>

#include "kp_bf16.h"
#include "kp_native.h"
#include "kp_team.h"

#define PAR_MIN_ROWS 32

/* o = bf16(w * (x * rsqrt(mean(x^2) + eps))) over one row of n (o may be x). */
static inline void gemma_norm_row(const uint16_t *x, const float *w, uint16_t *o, int64_t n,
                                  float eps) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + KP_VW <= n; i += KP_VW) {
        const vf v = vload_bf16(x + i);
        acc = vfma(v, v, acc);
    }
    float ss = vhsum(acc);
    for (; i < n; ++i) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i + KP_VW <= n; i += KP_VW)
        vstore_bf16_n(o + i, vload(w + i) * (vload_bf16(x + i) * inv), KP_VW);
    for (; i < n; ++i) o[i] = f32_to_bf16(w[i] * (bf16_to_f32(x[i]) * inv));
}

void kp_team_add_rms_norm_gemma_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                                     const float *w, uint16_t *out, int64_t rows,
                                     int64_t hidden, float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *xr = x + t * x_stride;
        if (residual) {
            uint16_t *r = residual + t * hidden;
            int64_t i = 0;
            for (; i + KP_VW <= hidden; i += KP_VW)
                vstore_bf16_n(r + i, vload_bf16(xr + i) + vload_bf16(r + i), KP_VW);
            for (; i < hidden; ++i) r[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(r[i]));
            xr = r;
        }
        gemma_norm_row(xr, w, out + t * hidden, hidden, eps);
    }
}

void kp_add_rms_norm_gemma_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                                const float *w, uint16_t *out, int64_t rows, int64_t hidden,
                                float eps) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_add_rms_norm_gemma_bf16(x, x_stride, residual, w, out, rows, hidden, eps);
}

void kp_team_qk_norm_gemma_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                                int64_t k_heads, int64_t head_dim, const float *q_w,
                                const float *k_w, float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t h = 0; h < q_heads + k_heads; ++h) {
            uint16_t *hx = x + t * row_stride + h * head_dim;
            gemma_norm_row(hx, h < q_heads ? q_w : k_w, hx, head_dim, eps);
        }
}

void kp_qk_norm_gemma_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t q_heads,
                           int64_t k_heads, int64_t head_dim, const float *q_w, const float *k_w,
                           float eps) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_qk_norm_gemma_bf16(x, row_stride, rows, q_heads, k_heads, head_dim, q_w, k_w, eps);
}

/* torch's tanh-GELU in fp32, in its order: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
 * tanh(u) = s (1 - q) with s the sign of u and q = 2 e / (1 + e), e = e^(-2|u|): q is
 * accurate even where it is tiny, so 1 - q rounds to about the fp32 value a correctly rounded
 * tanh gives, and 1 + tanh(u) cancels where torch's does (large negative u), to the same
 * fp32 steps; past |u| = 8.66 tanh is +-1 exactly, as in torch's vectorised tanh (SLEEF), so
 * the GELU of x below about -5.05 is 0 there too. (gemm.c's fp32 GeGLU avoids the cancellation;
 * here torch's bf16 result is what is matched.) */
static inline vf gelu_tanh(vf x) {
    const vf u = vset1(0.7978845608028654f) * (x + vset1(0.044715f) * (x * x * x));
    const vi neg = (vi)u < 0;  /* the sign bit: u < 0 */
    const vf a = (vf)((vi)u & 0x7fffffff);
    const vf e = vexp(vset1(-2.0f) * a);
    vf m = vset1(1.0f) - vset1(2.0f) * e / (vset1(1.0f) + e);  /* |tanh(u)| */
    m = vselect(a > vset1(8.664339742f), vset1(1.0f), m);  /* where torch's (SLEEF's) is 1 */
    const vf t = vselect(neg, -m, m);
    return vset1(0.5f) * x * (vset1(1.0f) + t);
}

void kp_team_gelu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *g = gu + t * 2 * inter, *u = g + inter;
        uint16_t *o = out + t * inter;
        for (int64_t i = 0; i < inter; i += KP_VW) {
            const int n = inter - i < KP_VW ? (int)(inter - i) : KP_VW;
            vf gv, uv;
            if (n == KP_VW) {
                gv = vload_bf16(g + i);
                uv = vload_bf16(u + i);
            } else {
                float gb[KP_VW] = {0}, ub[KP_VW] = {0};
                for (int j = 0; j < n; ++j) {
                    gb[j] = bf16_to_f32(g[i + j]);
                    ub[j] = bf16_to_f32(u[i + j]);
                }
                gv = vload(gb);
                uv = vload(ub);
            }
            const vf act = (vf)vbf16_hi(gelu_tanh(gv));  /* rounded to bf16, as torch's GELU */
            vstore_bf16_n(o + i, act * uv, n);
        }
    }
}

void kp_gelu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel if (rows >= PAR_MIN_ROWS)
    kp_team_gelu_mul_bf16(gu, out, rows, inter);
}
