/* MXFP4 weights times float rows, the weights decoded inside the loop (kp_native.h).
 *
 * gpt-oss's experts ship as MXFP4: per weight row, groups of 32 E2M1 values (two 4-bit codes a
 * byte, the even column low) sharing one E8M0 exponent. Kept 4-bit in memory, a weight row is
 * read once per call at half a byte a value: each thread decodes one row into a K-float scratch
 * in L1 (16-entry table times the group's power of two, exact in fp32) and dots the input
 * rows against it four at a time (each scratch load feeds four sums), so no float copy of the
 * weight ever exists outside that scratch.
 */
#include <math.h>
#include <stdlib.h>

#include "kp_native.h"

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Row n of the weight (K / 32 groups) decoded into w[K]. */
static void decode_row(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *w) {
    for (int64_t g = 0; g < groups; ++g) {
        const float s = ldexpf(1.0f, (int)scales[g] - 127);
        const uint8_t *b = blocks + g * 16;
        float *o = w + g * 32;
        for (int j = 0; j < 16; ++j) {
            o[2 * j] = E2M1[b[j] & 0x0F] * s;
            o[2 * j + 1] = E2M1[b[j] >> 4] * s;
        }
    }
}

int kp_mxfp4_linear_f32(const float *x, int64_t x_stride, int64_t M, const uint8_t *blocks,
                        const uint8_t *scales, int64_t N, int64_t K, const float *bias,
                        float *out, int64_t out_stride) {
    if (K <= 0 || K % 32 || M < 0 || N < 0) return -1;
    const int64_t groups = K / 32;
    int failed = 0;
#pragma omp parallel if (M * N * K > (1 << 16))
    {
        float *w = malloc((size_t)K * sizeof *w);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            if (!w) continue;
            decode_row(blocks + n * groups * 16, scales + n * groups, groups, w);
            const float b = bias ? bias[n] : 0.0f;
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) {  /* four rows per pass over the decoded row */
                const float *x0 = x + m * x_stride, *x1 = x0 + x_stride;
                const float *x2 = x1 + x_stride, *x3 = x2 + x_stride;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
                for (int64_t k = 0; k < K; ++k) {
                    a0 += x0[k] * w[k];
                    a1 += x1[k] * w[k];
                    a2 += x2[k] * w[k];
                    a3 += x3[k] * w[k];
                }
                out[m * out_stride + n] = a0 + b;
                out[(m + 1) * out_stride + n] = a1 + b;
                out[(m + 2) * out_stride + n] = a2 + b;
                out[(m + 3) * out_stride + n] = a3 + b;
            }
            for (; m < M; ++m) {
                const float *xr = x + m * x_stride;
                float acc = 0.0f;
                for (int64_t k = 0; k < K; ++k) acc += xr[k] * w[k];
                out[m * out_stride + n] = acc + b;
            }
        }
        free(w);
    }
    return failed ? -2 : 0;
}
