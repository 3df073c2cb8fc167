/* bf16 matrix product for nn.Linear on CPU: y[m, n] = bf16(sum_k x[m, k] * w[n, k] (+ bias[n])),
 * x, w, bias and y bf16, the sum in fp32, y rounded once (nearest even), as F.linear in bf16.
 *
 * Why our own: in a bf16 step on an AVX512-BF16 CPU without AMX, oneDNN's pre-packed bf16
 * linear was 58% of the time (issue 30), and at decode row counts it reads the weights well
 * below the memory bandwidth, as its fp32 kernel did (gemm.c). This is gemm.c's scheme over
 * bf16 weights, half the bytes.
 *
 * The weight is packed once (kernels/kserve_paged_kernels/cpu_native/gemm.py, pack_gemm_weight_bf16) into column
 * panels of NR = KP_GEMM_PANEL outputs, each a run of K / 2 rows of NR 32-bit lanes: lane j of
 * row k2 holds w[p * NR + j][2 k2] (low half) and w[p * NR + j][2 k2 + 1] (high half), zero for
 * j past N. That is the operand layout of vdpbf16ps: at the avx512_bf16 and amx levels one
 * instruction multiplies a broadcast pair of x with the pairs of 16 columns and adds both
 * products to fp32 (products of two bf16 are exact in fp32, so only the sum order differs
 * from fp32 arithmetic over the same values). The other levels split each lane exactly into
 * two fp32 values (shift, mask) and use two FMAs. K must be even (every model's is; the
 * Python side falls back otherwise).
 */
#include <stdint.h>

#include "kp_bf16.h"
#include "kp_native.h"
#include "kp_team.h"
#include "kp_vec.h"

#define NR KP_GEMM_PANEL
#define NV (NR / KP_VW)
#if defined(__AVX512BF16__)
#define MR 8 /* 24 accumulators, 3 weight vectors, 1 broadcast */
#elif KP_VREGS >= 32
#define MR 6 /* 18 accumulators, 6 widened weight vectors, 2 broadcasts */
#else
#define MR 4 /* 8 accumulators, 4 widened weight vectors, 2 broadcasts */
#endif
#define MB 256 /* rows per block of x */
#define LINE_LANES 16 /* 32-bit lanes per cache line */

typedef uint32_t vu_unaligned __attribute__((vector_size(4 * KP_VW), aligned(4), may_alias));

/* acc += the pair of x at xp times the pairs of w, lane by lane. */
static inline __attribute__((always_inline)) vf pair_fma(vf acc, const uint16_t *xp, vu w) {
#if defined(__AVX512BF16__)
    uint32_t bits;
    __builtin_memcpy(&bits, xp, 4);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)bits), (__m512bh)w);
#else
    const vf lo = (vf)(w << 16), hi = (vf)(w & 0xffff0000u);
    acc = vfma(vset1(bf16_to_f32(xp[0])), lo, acc);
    return vfma(vset1(bf16_to_f32(xp[1])), hi, acc);
#endif
}

/* Rows [0, mr) of x times one panel, rounded into y; columns past `ncols` are not stored. */
static inline __attribute__((always_inline)) void panel_block(
    const uint16_t *x, int64_t ldx, const uint32_t *panel, int64_t K2, const float *bias,
    uint16_t *y, int64_t ldy, int ncols, const int mr, const uint32_t *prefetch, int pf_every) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = bias ? vload(bias + KP_VW * v) : vzero();
    const uint32_t *pf = prefetch;
    int countdown = pf_every;
    for (int64_t k = 0; k < K2; ++k) {
        const uint32_t *wk = panel + k * NR;
        if (pf && --countdown == 0) {
            countdown = pf_every;
            for (int c = 0; c < NR; c += LINE_LANES) __builtin_prefetch(pf + c, 0, 2);
            pf += NR;
        }
        vu w[NV];
        for (int v = 0; v < NV; ++v) w[v] = *(const vu_unaligned *)(wk + KP_VW * v);
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < NV; ++v) acc[i][v] = pair_fma(acc[i][v], x + i * ldx + 2 * k, w[v]);
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV && KP_VW * v < ncols; ++v)
            vstore_bf16_n(y + i * ldy + KP_VW * v, acc[i][v], ncols - KP_VW * v);
}

#define MAX_SPREAD 4
#define TAIL(R) \
    case R: if ((R) < MR) panel_block(x + m * ldx, ldx, panel, K2, bias, y + m * ldy, ldy, ncols, R, PF(b), every); break;

/* All row blocks of x times one panel; the first `spread` blocks prefetch a slice each of the
 * next panel (gemm.c says why). Declared in kp_bf16.h. */
void kp_bf16_panel_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *panel,
                        int64_t K2, const float *bias, uint16_t *y, int64_t ldy, int ncols,
                        const uint32_t *next_panel) {
    const int64_t blocks = (M + MR - 1) / MR;
    const int spread = blocks < MAX_SPREAD ? (int)blocks : MAX_SPREAD;
    const int64_t slice = (K2 + spread - 1) / spread;
    const int every = spread;
    int64_t m = 0, b = 0;
#define PF(b) (next_panel && (b) < spread ? next_panel + (b) * slice * NR : 0)
    for (; m + MR <= M; m += MR, ++b)
        panel_block(x + m * ldx, ldx, panel, K2, bias, y + m * ldy, ldy, ncols, MR, PF(b), every);
    switch (M - m) { /* constant row counts so each tail keeps its accumulators in registers */
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
    default: break;
    }
#undef PF
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the pair-packed weight
 * (+ bias), all bf16; panels split evenly over the threads (a team body, kp_team.h). */
void kp_team_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *packed,
                       int64_t K, int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const int64_t panels = (N + NR - 1) / NR, K2 = K / 2;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = (M - m0) < MB ? (M - m0) : MB;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t n0 = p * NR;
            const int ncols = (N - n0) < NR ? (int)(N - n0) : NR;
            float bias32[NR];
            if (bias)
                for (int c = 0; c < NR; ++c) bias32[c] = c < ncols ? bf16_to_f32(bias[n0 + c]) : 0;
            kp_bf16_panel_rows(x + m0 * ldx, ldx, mb, packed + p * K2 * NR, K2,
                               bias ? bias32 : 0, y + m0 * ldy + n0, ldy, ncols,
                               p + 1 < panels ? packed + (p + 1) * K2 * NR : 0);
        }
    }
}

/* The team body in a region of its own; -1: K odd. */
int kp_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *packed, int64_t K,
                 int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    if (K % 2) return -1;
    if (M <= 0 || N <= 0) return 0;
#pragma omp parallel
    kp_team_gemm_bf16(x, ldx, M, packed, K, N, bias, y, ldy);
    return 0;
}
