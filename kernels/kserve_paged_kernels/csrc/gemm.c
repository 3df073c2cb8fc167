/* fp32 matrix product for nn.Linear on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Why our own: at the row counts a serving step has (1-128 rows: decode batches) oneDNN's packed
 * kernel splits the work poorly over 2 threads, well below the FMA peak, and at 1-16 rows it reads
 * the weights at about half the memory bandwidth (figures in BENCHMARKS.md).
 * This kernel gives each thread an equal share of column panels and walks them in memory order.
 *
 * The weight is packed once (kernels/kserve_paged_kernels/cpu_native/gemm.py) into column panels of NR =
 * KP_GEMM_PANEL outputs: packed[p][k][j] = w[p * NR + j][k], zero for j past N. A panel is read
 * front to back, so the hardware prefetcher streams it; rows are taken MR at a time with MR x NV
 * accumulators in registers (NV = NR / KP_VW vectors a row), the x values broadcast from memory
 * into the FMAs. The blocking follows the register file (kp_vec.h): AVX-512, 32 registers:
 * 8 rows x 3 vectors (48 columns), 24 accumulators; AVX2, 16 registers: 6 rows x 2 vectors
 * (16 columns), 12 accumulators. Written once over kp_vec.h for every level.
 */
#include <stdint.h>

#include "kp_native.h"
#include "kp_vec.h"

#define NR KP_GEMM_PANEL
#define NV (NR / KP_VW)
#if KP_VREGS >= 32
#define MR 8
#else
#define MR 6
#endif
#define MB 256 /* rows per block of x: a block stays in L2 while every panel passes over it */
#define LINE 16 /* floats per cache line */

_Static_assert(NR % KP_VW == 0, "a panel is whole vectors");
_Static_assert(MR * NV + NV + 1 <= KP_VREGS, "the register tile fits the register file");

int kp_gemm_panel(void) { return NR; }

/* Rows [0, mr) of x times the first nv vectors of one panel; columns past `ncols` (< NR at
 * the tail) are not stored. nv < NV only where the vectors past it hold no column (a tail
 * panel: the zero padding is neither multiplied nor read). */
static inline __attribute__((always_inline)) void panel_block(
    const float *x, int64_t ldx, const float *panel, int64_t K, const float *bias,
    float *y, int64_t ldy, int ncols, const int mr, const int nv, const float *prefetch,
    const int pf_every, float *ynext) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nv; ++v) {
            const int c = ncols - KP_VW * v;  /* columns of this vector that exist */
            acc[i][v] = !bias || c <= 0 ? vzero()
                        : c >= KP_VW    ? vload(bias + KP_VW * v)
                                        : vload_n(bias + KP_VW * v, c);
        }
    /* One row of the next panel is prefetched every `pf_every` steps of k, so a panel used by
     * several row blocks spreads the next panel's fetch over all of them. */
    const float *pf = prefetch;
    int countdown = pf_every;
    enum { YLINES = (NR + LINE - 1) / LINE };  /* cache lines of one output row of a panel */
    for (int64_t k = 0; k < K; ++k) {
        const float *wk = panel + k * NR;
        if (pf && --countdown == 0) {
            countdown = pf_every;
            for (int c = 0; c < NR; c += LINE) __builtin_prefetch(pf + c, 0, 2);
            pf += NR;
        }
        if (ynext && (k & 15) == 0 && (k >> 4) < YLINES * MR) {
            /* The next block's MR x NR outputs, one line every 16 steps of k, for writing: their
             * first touch would otherwise stall the stores at the end of that block. */
            const int line = (int)(k >> 4);
            __builtin_prefetch(ynext + (line / YLINES) * ldy + (line % YLINES) * LINE, 1, 3);
        }
        vf w[NV];
        for (int v = 0; v < nv; ++v) w[v] = vload(wk + KP_VW * v);
        for (int i = 0; i < mr; ++i) {
            const vf a = vset1(x[i * ldx + k]);
            for (int v = 0; v < nv; ++v) acc[i][v] = vfma(a, w[v], acc[i][v]);
        }
    }
    if (ncols == nv * KP_VW) {
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < nv; ++v) vstore(y + i * ldy + KP_VW * v, acc[i][v]);
    } else {
        for (int i = 0; i < mr; ++i) {
            for (int v = 0; v < nv; ++v) {
                const int c = ncols - KP_VW * v;
                if (c <= 0) break;
                if (c >= KP_VW)
                    vstore(y + i * ldy + KP_VW * v, acc[i][v]);
                else
                    vstore_n(y + i * ldy + KP_VW * v, acc[i][v], c);
            }
        }
    }
}

/* All row blocks of x times one panel. Each block reads the panel from L1/L2 once the first
 * has touched it; the next panel (from DRAM: weights do not stay in cache between steps) is
 * prefetched by the first `spread` blocks, a slice each. Spreading it matters at 16-64 rows:
 * with the whole fetch in the first block, that block outran the memory system and stalled
 * (bench/probes/linear_gemm.py measures it; figures in BENCHMARKS.md). */
#define TAIL(R, EVERY) /* a tail of R rows exists only when R < MR */                                    \
    case R: if ((R) < MR) panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, R, NVEC, PF(b), EVERY, 0); break;
#define PANEL_ROWS_BODY(EVERY)                                                                   \
    for (; m + MR <= M; m += MR, ++b)                                                            \
        panel_block(x + m * ldx, ldx, panel, K, bias, y + m * ldy, ldy, ncols, MR, NVEC, PF(b), EVERY, \
                    m + 2 * MR <= M ? y + (m + MR) * ldy : next_panel ? y + NR : 0);             \
    switch (M - m) { /* constant row counts so each tail keeps its accumulators in registers */  \
    TAIL(1, EVERY) TAIL(2, EVERY) TAIL(3, EVERY) TAIL(4, EVERY) TAIL(5, EVERY) TAIL(6, EVERY)        \
    TAIL(7, EVERY)                                                                               \
    default: break;                                                                              \
    }
#define MAX_SPREAD 4

static inline __attribute__((always_inline)) void panel_rows_nv(
    const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, const float *bias,
    float *y, int64_t ldy, int ncols, const float *next_panel, const int NVEC) {
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

/* panel_rows_nv with the vectors that hold columns: all NV but at a tail panel (N = 640 is 13
 * AVX-512 panels and one of 16 columns: a whole panel's work for a third of it). */
static void panel_rows(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K,
                       const float *bias, float *y, int64_t ldy, int ncols,
                       const float *next_panel) {
    const int nvec = (ncols + KP_VW - 1) / KP_VW;
    if (NV > 1 && nvec == 1)
        panel_rows_nv(x, ldx, M, panel, K, bias, y, ldy, ncols, next_panel, 1);
#if NV > 2
    else if (nvec == 2)
        panel_rows_nv(x, ldx, M, panel, K, bias, y, ldy, ncols, next_panel, 2);
#endif
    else
        panel_rows_nv(x, ldx, M, panel, K, bias, y, ldy, ncols, next_panel, NV);
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weight (+ bias).
 * Rows are cut into blocks of MB so a block of x stays in L2 while every panel passes over it.
 * One parallel region over (row block, panel) pairs in that order, split evenly: up to MB rows
 * the panels are split over the threads; past it the rows are cut into blocks of equal size
 * and each thread takes whole row blocks (every panel over its own block of x). One region, not one per row block: an encoder step of
 * thousands of rows made hundreds of fork/join barriers a layer, and on a shared machine each
 * barrier waits for the slowest thread (BENCHMARKS.md, embeddings). */
int kp_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                int64_t N, const float *bias, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NR - 1) / NR, blocks = (M + MB - 1) / MB;
    /* Blocks of equal size (a multiple of MR, at most MB + MR - 1), so whole blocks balance. */
    const int64_t bm = ((M + blocks - 1) / blocks + MR - 1) / MR * MR;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < blocks * panels; ++it) {
        const int64_t m0 = (it / panels) * bm, p = it % panels;
        const int64_t mb = (M - m0) < bm ? (M - m0) : bm;
        if (mb <= 0) continue;
        const int64_t n0 = p * NR;
        const int ncols = (N - n0) < NR ? (int)(N - n0) : NR;
        panel_rows(x + m0 * ldx, ldx, mb, packed + p * K * NR, K, bias ? bias + n0 : 0,
                   y + m0 * ldy + n0, ldy, ncols,
                   p + 1 < panels ? packed + (p + 1) * K * NR : 0);
    }
    return 0;
}

/* The gated MLP's first half: act [M, inter] = f(x Wg^T + bg) * (x Wu^T + bu), f SiLU (SwiGLU)
 * or tanh-GELU (GeGLU: Gemma), with the gate and up weights packed as panel pairs (panel 2q:
 * gate outputs NR q .. NR q + NR - 1, panel 2q + 1: the same up outputs;
 * cpu_native.pack_gate_up_weight). One thread computes both panels of a pair and applies the
 * activation-and-multiply to them at once, while they are in its own cache. Separately, the
 * activation pass read half of its input from the other core's cache (the GEMM splits columns,
 * the pass rows), measurably slower, and for GeGLU torch's GELU was a pass of its own.
 * `gu` is scratch of [M, 2 * pairs * NR] (row stride ldgu).
 * Both activations are g * sigmoid(z): z = g for SiLU; for tanh-GELU,
 * 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), a form
 * without the cancellation of 1 + tanh(u) at large negative u. */
static inline __attribute__((always_inline)) int gemm_act(
    const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K, int64_t inter,
    const float *bias, float *gu, int64_t ldgu, float *act, int64_t ldact, const int gelu) {
    if (M <= 0 || inter <= 0) return 0;
    const int64_t pairs = (inter + NR - 1) / NR;
    if (ldgu < 2 * pairs * NR) return -1;
    const float c1 = 1.5957691216057308f;             /* 2 sqrt(2 / pi) */
    const float c3 = 1.5957691216057308f * 0.044715f; /* times the cubic's coefficient */
    /* One region over (row block, pair) in that order, split evenly, as kp_gemm_f32 splits
     * (row block, panel): past MB rows each thread takes whole row blocks. */
    const int64_t blocks = (M + MB - 1) / MB;
    const int64_t bm = ((M + blocks - 1) / blocks + MR - 1) / MR * MR;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < blocks * pairs; ++it) {
        const int64_t m0 = (it / pairs) * bm, q = it % pairs;
        const int64_t mb = (M - m0) < bm ? (M - m0) : bm;
        if (mb > 0) {
            const int64_t c0 = q * NR;
            const int ncols = (inter - c0) < NR ? (int)(inter - c0) : NR;
            const float *gate = packed + 2 * q * K * NR, *up = gate + K * NR;
            float *yg = gu + m0 * ldgu + 2 * c0, *yu = yg + NR;
            panel_rows(x + m0 * ldx, ldx, mb, gate, K, bias ? bias + 2 * c0 : 0, yg, ldgu, NR,
                       up);
            panel_rows(x + m0 * ldx, ldx, mb, up, K, bias ? bias + 2 * c0 + NR : 0, yu, ldgu, NR,
                       q + 1 < pairs ? up + K * NR : 0);
            for (int64_t i = 0; i < mb; ++i) {
                const float *g = yg + i * ldgu, *u = yu + i * ldgu;
                float *o = act + (m0 + i) * ldact + c0;
                for (int c = 0; c < ncols; c += KP_VW) {
                    const vf gv = vload(g + c);
                    vf z = gv;
                    if (gelu) z = gv * vfma(gv * gv, vset1(c3), vset1(c1));
                    const vf r = gv / (1.0f + vexp(-z)) * vload(u + c);
                    if (ncols - c >= KP_VW)
                        vstore(o + c, r);
                    else
                        vstore_n(o + c, r, ncols - c);
                }
            }
        }
    }
    return 0;
}

int kp_gemm_silu_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                     int64_t inter, const float *bias, float *gu, int64_t ldgu, float *act,
                     int64_t ldact) {
    return gemm_act(x, ldx, M, packed, K, inter, bias, gu, ldgu, act, ldact, 0);
}

int kp_gemm_gelu_f32(const float *x, int64_t ldx, int64_t M, const float *packed, int64_t K,
                     int64_t inter, const float *bias, float *gu, int64_t ldgu, float *act,
                     int64_t ldact) {
    return gemm_act(x, ldx, M, packed, K, inter, bias, gu, ldgu, act, ldact, 1);
}
