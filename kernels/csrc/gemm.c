/* fp32 matrix product for nn.Linear on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Why our own: at the row counts a serving step has (1-128 rows: decode batches) oneDNN's packed
 * kernel splits the work poorly over 2 threads, well below the FMA peak, and at 1-16 rows it reads
 * the weights at about half the memory bandwidth (figures in BENCHMARKS.md).
 * This kernel gives each thread an equal share of column panels and walks them in memory order.
 *
 * The weight is packed once (kernels/cpu_native/gemm.py) into column panels of NR = 48 outputs:
 * packed[p][k][j] = w[p * 48 + j][k], zero for j past N. A panel is read front to back, so the
 * hardware prefetcher streams it; rows are taken MR = 8 at a time with 8 x 3 accumulators in
 * registers (24 of the 32 zmm), the x values broadcast straight from memory into the FMAs.
 */
#include <stdint.h>

#include "kp_native.h"

#define NR KP_GEMM_PANEL
#define MR 8
#define MB 256 /* rows per block of x: a block stays in L2 while every panel passes over it */

#ifdef __AVX512F__
#include <immintrin.h>

#include "simd_exp.h"

int kp_gemm_available(void) { return 1; }

/* Rows [0, mr) of x times one panel; columns past `ncols` (< NR at the tail) are not stored. */
static inline __attribute__((always_inline)) void panel_block(
    const float *x, int64_t ldx, const float *panel, int64_t K, const float *bias,
    float *y, int64_t ldy, int ncols, const int mr, const float *prefetch, const int pf_every, float *ynext) {
    __m512 acc[MR][3];
    for (int i = 0; i < mr; ++i) {
        if (bias) {
            const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
            const __mmask16 m1 = ncols >= 32 ? 0xFFFF
                                 : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
            const __mmask16 m2 = ncols >= 48 ? 0xFFFF
                                 : ncols <= 32 ? 0 : (__mmask16)((1u << (ncols - 32)) - 1);
            acc[i][0] = _mm512_maskz_loadu_ps(m0, bias);
            acc[i][1] = _mm512_maskz_loadu_ps(m1, bias + 16);
            acc[i][2] = _mm512_maskz_loadu_ps(m2, bias + 32);
        } else {
            acc[i][0] = _mm512_setzero_ps();
            acc[i][1] = _mm512_setzero_ps();
            acc[i][2] = _mm512_setzero_ps();
        }
    }
    /* One row of the next panel (3 lines) is prefetched every `pf_every` steps of k, so a
     * panel used by several row blocks spreads the next panel's fetch over all of them. */
    const float *pf = prefetch;
    int countdown = pf_every;
    for (int64_t k = 0; k < K; ++k) {
        const float *wk = panel + k * NR;
        if (pf && --countdown == 0) {
            countdown = pf_every;
            __builtin_prefetch(pf, 0, 2);
            __builtin_prefetch(pf + 16, 0, 2);
            __builtin_prefetch(pf + 32, 0, 2);
            pf += NR;
        }
        if (ynext && (k & 15) == 0 && (k >> 4) < 3 * MR) {
            /* The next block's 8 x 48 outputs, one line every 16 steps of k, for writing: their
             * first touch would otherwise stall the stores at the end of that block. */
            const int line = (int)(k >> 4);
            __builtin_prefetch(ynext + (line / 3) * ldy + (line % 3) * 16, 1, 3);
        }
        const __m512 w0 = _mm512_load_ps(wk);
        const __m512 w1 = _mm512_load_ps(wk + 16);
        const __m512 w2 = _mm512_load_ps(wk + 32);
        for (int i = 0; i < mr; ++i) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(a, w2, acc[i][2]);
        }
    }
    if (ncols == NR) {
        for (int i = 0; i < mr; ++i) {
            _mm512_storeu_ps(y + i * ldy, acc[i][0]);
            _mm512_storeu_ps(y + i * ldy + 16, acc[i][1]);
            _mm512_storeu_ps(y + i * ldy + 32, acc[i][2]);
        }
    } else {
        for (int i = 0; i < mr; ++i) {
            for (int v = 0; v < 3; ++v) {
                const int c = ncols - 16 * v;
                if (c <= 0) break;
                const __mmask16 m = c >= 16 ? 0xFFFF : (__mmask16)((1u << c) - 1);
                _mm512_mask_storeu_ps(y + i * ldy + 16 * v, m, acc[i][v]);
            }
        }
    }
}

/* All row blocks of x times one panel. Each block reads the panel from L1/L2 once the first
 * has touched it; the next panel (from DRAM: weights do not stay in cache between steps) is
 * prefetched by the first `spread` blocks, a slice each. Spreading it matters at 16-64 rows:
 * with the whole fetch in the first block, that block outran the memory system and stalled
 * (bench/probes/linear_gemm.py measures it; figures in BENCHMARKS.md). */
#define PANEL_ROWS_BODY(EVERY)                                                                   \
    for (; m + MR <= M; m += MR, ++b)                                                            \
        panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, MR, PF(b), EVERY, \
                    m + 2 * MR <= M ? y + (m + MR) * ldy : next_panel ? y + NR : 0); \
    switch (M - m) { /* constant row counts so each tail keeps its accumulators in registers */  \
    case 1: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 1, PF(b), EVERY, 0); break; \
    case 2: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 2, PF(b), EVERY, 0); break; \
    case 3: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 3, PF(b), EVERY, 0); break; \
    case 4: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 4, PF(b), EVERY, 0); break; \
    case 5: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 5, PF(b), EVERY, 0); break; \
    case 6: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 6, PF(b), EVERY, 0); break; \
    case 7: panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, 7, PF(b), EVERY, 0); break; \
    default: break;                                                                              \
    }
#define MAX_SPREAD 4

static void panel_rows(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K,
                       const float *bias, float *y, int64_t ldy, int ncols,
                       const float *next_panel) {
    const int64_t blocks = (M + MR - 1) / MR;
    const int spread = blocks < MAX_SPREAD ? (int)blocks : MAX_SPREAD;
    const int64_t slice = (K + spread - 1) / spread;  /* next-panel rows per prefetching block */
    int64_t m = 0, b = 0;
#define PF(b) (next_panel && (b) < spread ? next_panel + (b) * slice * NR : 0)
    if (spread == 1) {  /* a constant so the single-block loop keeps its plain form */
        PANEL_ROWS_BODY(1)
    } else {
        PANEL_ROWS_BODY(spread)
    }
#undef PF
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weight (+ bias).
 * Rows are cut into blocks of MB so a block of x stays in L2 while every panel passes over it;
 * panels are split evenly over the threads. */
int kp_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                int64_t N, const float *bias, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = (M - m0) < MB ? (M - m0) : MB;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t n0 = p * NR;
            const int ncols = (N - n0) < NR ? (int)(N - n0) : NR;
            panel_rows(x + m0 * ldx, ldx, mb, packed + p * K * NR, K, bias ? bias + n0 : 0,
                       y + m0 * ldy + n0, ldy, ncols,
                       p + 1 < panels ? packed + (p + 1) * K * NR : 0);
        }
    }
    return 0;
}

/* The SwiGLU MLP's first half: act [M, inter] = silu(x Wg^T + bg) * (x Wu^T + bu), with the
 * gate and up weights packed as panel pairs (panel 2q: gate outputs 48q .. 48q + 47, panel
 * 2q + 1: the same up outputs; cpu_native.pack_gate_up_weight). One thread computes both
 * panels of a pair and applies the SiLU-and-multiply to them at once, while they are in its
 * own cache. Separately, the SiLU pass read half of its input from the other core's cache
 * (the GEMM splits columns, the pass rows), measurably slower.
 * `gu` is scratch of [M, 2 * pairs * 48] (row stride ldgu). */
int kp_gemm_silu_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                     int64_t inter, const float *bias, float *gu, int64_t ldgu, float *act,
                     int64_t ldact) {
    if (M <= 0 || inter <= 0) return 0;
    const int64_t pairs = (inter + NR - 1) / NR;
    if (ldgu < 2 * pairs * NR) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = (M - m0) < MB ? (M - m0) : MB;
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < pairs; ++q) {
            const int64_t c0 = q * NR;
            const int ncols = (inter - c0) < NR ? (int)(inter - c0) : NR;
            const float *gate = packed + 2 * q * K * NR, *up = gate + K * NR;
            float *yg = gu + m0 * ldgu + 2 * c0, *yu = yg + NR;
            panel_rows(x + m0 * ldx, ldx, mb, gate, K, bias ? bias + 2 * c0 : 0, yg, ldgu, NR,
                       up);
            panel_rows(x + m0 * ldx, ldx, mb, up, K, bias ? bias + 2 * c0 + NR : 0, yu, ldgu, NR,
                       q + 1 < pairs ? up + K * NR : 0);
            const __m512 one = _mm512_set1_ps(1.0f);
            for (int64_t i = 0; i < mb; ++i) {
                const float *g = yg + i * ldgu, *u = yu + i * ldgu;
                float *o = act + (m0 + i) * ldact + c0;
                for (int c = 0; c < ncols; c += 16) {
                    const __mmask16 k = (ncols - c) >= 16 ? 0xFFFF
                                        : (__mmask16)((1u << (ncols - c)) - 1);
                    const __m512 gv = _mm512_loadu_ps(g + c);
                    const __m512 sig = _mm512_div_ps(
                        one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                    _mm512_mask_storeu_ps(o + c, k,
                                          _mm512_mul_ps(_mm512_mul_ps(gv, sig),
                                                        _mm512_loadu_ps(u + c)));
                }
            }
        }
    }
    return 0;
}
#else
int kp_gemm_available(void) { return 0; }
int kp_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                int64_t N, const float *bias, float *y, int64_t ldy) {
    (void)x; (void)ldx; (void)M; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy;
    return -1;
}
int kp_gemm_silu_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                     int64_t inter, const float *bias, float *gu, int64_t ldgu, float *act,
                     int64_t ldact) {
    (void)x; (void)ldx; (void)M; (void)packed; (void)K; (void)inter; (void)bias; (void)gu;
    (void)ldgu; (void)act; (void)ldact;
    return -1;
}
#endif
