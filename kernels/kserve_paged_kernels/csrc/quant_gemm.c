/* Weight-only quantized GEMM with float32 activations: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias),
 * where w is stored as 4-bit codes with a scale and a minimum per group of G weights along k
 * (`w = q * scale + minimum`: GGUF's Q4_0/Q4_1/Q4_K) or as int8 codes with one scale per group
 * (`w = q * scale`: GGUF's Q8_0; a group of K is one scale per output channel).
 *
 * Why our own: PyTorch's packed int4/int8 CPU kernels take a slow path with float32 activations
 * (10-90x F.linear, BENCHMARKS.md), and float32 activations are what keep a GGUF's fp16 scales
 * exact. A decode step is bound by the weights' bytes, so the codes are dequantized in registers,
 * never written back: the weight costs 4 (or 8) bits plus its group's scales per read.
 *
 * Layout (kernels/kserve_paged_kernels/cpu_native/quant_gemm.py packs it once at load): output columns in panels of
 * NR = KP_GEMM_PANEL (the fp32 GEMM's width), each panel a run of groups, each group one block:
 *   int4: [NR float scales][NR float minimums][G / 2 rows of NR bytes], byte j of row r holding
 *         column j's codes for k = 2r (low nibble) and k = 2r + 1 (high nibble);
 *   int8: [NR float scales][G rows of NR int8 codes];
 *   e4m3 (bits KP_QUANT_E4M3): int8's layout with fp8 e4m3 codes and scales stored times 2^8,
 *         `w = fp8(q) * scale` (an fp8 checkpoint's weights kept at one byte; each code
 *         decoded exactly in registers to fp8(q) / 2^8 through fp16).
 * Columns past N are zero codes with zero scales. A panel is read front to back (the hardware
 * prefetcher streams it); panels are split evenly over the threads, as in gemm.c. Rows of x go
 * MR at a time with MR x NV accumulators; the codes of one k are widened to NV vectors of fp32
 * weights (one FMA with the group's scale and minimum, so each weight is the reference's
 * `q * scale + minimum` up to that one rounding) and used by all MR rows. From TILE_MIN rows on
 * (prefill) each thread instead dequantizes a whole panel once into an fp32 tile in its cache
 * and runs the fp32 GEMM's register tile (MRF rows) over it: the same weights and the same
 * order of FMAs, so both paths give the same bits.
 *
 * bf16 activations (kp_quant_gemm_bf16: x, bias and y bf16, sums fp32, each output rounded once,
 * as F.linear in bf16), three paths by the rows of a block of x:
 *   - below TILE_MIN_BF16 rows (4 bits and int8 at the avx512_bf16 and amx levels: below
 *     DOT_MIN_BF16) the register path above, each bf16 of x widened exactly, so the weights
 *     are the fp32 path's;
 *   - 4 bits from DOT_MIN_BF16 to DOT_MAX_BF16 rows, int8 to DOT_MAX_INT8, at the avx512_bf16
 *     and amx levels (decode batches): no weight is formed. Each code becomes the bf16 of its
 *     integer (exact: a vpermw lookup for 4 bits, the float conversion for int8, at most 8
 *     significant bits), vdpbf16ps sums x times the codes of one group in fp32 (each product
 *     exact), and the group's scale (and minimum) are applied to those partial sums,
 *     y += s P (+ m X, X the group's sum of the row of x, computed once per call):
 *     sum_k x (q s + m) without rounding any weight, only fp32 sums rounded (as in the fp32
 *     path). Row blocks of MRQ take MRQ x NV partial sums in registers and add them to the
 *     thread's fp32 sums in L1 once per group; that per-group work (two FMAs per sum vector
 *     for 4 bits, one for int8) is what the pair tile below avoids, so the tile is faster again
 *     from DOT_MAX_BF16 (DOT_MAX_INT8) rows on;
 *   - otherwise each thread dequantizes a panel once into a tile of bf16 pairs (each weight
 *     `q * scale + minimum` in fp32, then rounded to bf16 once, nearest even) laid out as
 *     gemm_bf16.c's packed panels, and runs that GEMM's register tile (kp_bf16_panel_rows:
 *     vdpbf16ps at the avx512_bf16 and amx levels, exact widening and FMAs elsewhere) over it.
 *     Its weights are thus the dequantized weights rounded to bf16 (a relative 2^-8 at most),
 *     the price of the bf16 dot products.
 * The thresholds are where each path is measured faster (BENCHMARKS.md, "quantized weights with
 * bf16 activations"). Pair tiles need an even group (every 4-bit group is; int8: -1 otherwise).
 */
#include <stdint.h>
#include <stdlib.h>

#include "kp_bf16.h"
#include "kp_native.h"
#include "kp_team.h"
#include "kp_vec.h"

#define NR KP_GEMM_PANEL
#define NV (NR / KP_VW)
#define MR 4
#define MB 128 /* rows per block of x, so a block stays in L2 while the panels pass */
#define TILE_MIN 16 /* rows from which a panel is dequantized once into an fp32 tile */
#define TILE_MIN_BF16 8 /* bf16 rows from which a panel is dequantized once into bf16 pairs */
#define MB_BF16 256 /* bf16 rows per block of x (as gemm_bf16.c) */
#define DOT_MIN_BF16 2 /* bf16 rows from which 4-bit and int8 codes take the dot path ... */
#define DOT_MAX_BF16 40 /* ... and from which the pair tile again (4 bits; measured) */
#define DOT_MAX_INT8 64 /* the same for int8 (one FMA per group less) */
#if KP_VREGS >= 32
#define MRF 8 /* rows of the fp32 tile's register block (as gemm.c) */
#else
#define MRF 6
#endif

/* Accumulators, one k pair of widened weights and two broadcasts in registers (the scales and
 * minimums may be re-read from L1). */
_Static_assert(MR * NV + 2 * NV + 2 <= KP_VREGS, "the register tile fits the register file");

/* KP_VW bytes as int32 lanes, zero- or sign-extended. */
static inline vi vload_u8(const uint8_t *p) {
#if KP_VW == 16
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

static inline vi vload_i8(const uint8_t *p) {
#if KP_VW == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

static inline vf vfloat(vi v) { return __builtin_convertvector(v, vf); }

/* KP_VW fp8 e4m3 codes as their exact fp32 values divided by 2^8 (the packing multiplies the
 * scales by 2^8): each code sign-extended to 16 bits and shifted left by 7 is the fp16 whose
 * exponent field is the code's with fp16's bias 15 read in place of e4m3's 7 (so 2^-8 of the
 * value) once bit 14, the sign's copy, is cleared; subnormal codes become fp16 subnormals,
 * which the F16C conversion reads exactly (it ignores denormals-are-zero). */
static inline vf vload_e4m3(const uint8_t *p) {
#if KP_VW == 16
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7),
                                                _mm256_set1_epi16(0xBFFF)));
#else
    const __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return (vf)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(0xBFFF)));
#endif
}

/* One k's KP_VW codes of an 8-bit-layout weight as fp32 (int8 or e4m3, `bits` constant). */
static inline vf vload_q8(const uint8_t *p, const int bits) {
    return bits == KP_QUANT_E4M3 ? vload_e4m3(p) : vfloat(vload_i8(p));
}

/* Element i of x: fp32, or bf16 widened exactly (`bf` constant after inlining). */
static inline __attribute__((always_inline)) float xval(const void *x, int64_t i, const int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* x or y moved by `i` elements of its type. */
static inline __attribute__((always_inline)) const void *at(const void *p, int64_t i,
                                                             const int bf) {
    return (const char *)p + i * (bf ? 2 : 4);
}

/* The first n lanes of v to element `i` of y: fp32, or rounded to bf16. */
static inline __attribute__((always_inline)) void ystore_n(void *y, int64_t i, vf v, int n,
                                                           const int bf) {
    if (bf)
        vstore_bf16_n((uint16_t *)y + i, v, n);
    else if (n >= KP_VW)
        vstore((float *)y + i, v);
    else
        vstore_n((float *)y + i, v, n);
}

int64_t kp_quant_block_bytes(int32_t bits, int64_t group) {
    if ((bits != 4 && bits != 8 && bits != KP_QUANT_E4M3) || group <= 0 || (bits == 4 && group % 2))
        return -1;
    return bits == 4 ? 8 * NR + group / 2 * NR : 4 * NR + group * NR;
}

/* Rows [0, mr) of x times one panel (`bits` and `mr` constant after inlining). */
static inline __attribute__((always_inline)) void qpanel_block(
    const void *x, int64_t ldx, const uint8_t *panel, int64_t K, int64_t G, int64_t blk,
    const float *bias, void *y, int64_t ldy, int ncols, const int mr, const int bits,
    const int bf) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV; ++v) {
            const int c = ncols - KP_VW * v;
            acc[i][v] = !bias || c <= 0 ? vzero()
                        : c >= KP_VW    ? vload(bias + KP_VW * v)
                                        : vload_n(bias + KP_VW * v, c);
        }
    for (int64_t k0 = 0; k0 < K; k0 += G, panel += blk) {
        const float *sc = (const float *)panel;
        vf s[NV];
        for (int v = 0; v < NV; ++v) s[v] = vload(sc + KP_VW * v);
        if (bits == 4) {
            vf mn[NV];
            for (int v = 0; v < NV; ++v) mn[v] = vload(sc + NR + KP_VW * v);
            const uint8_t *q = panel + 8 * NR;
            for (int64_t r = 0; r < G / 2; ++r, q += NR) {
                vf w0[NV], w1[NV];
                for (int v = 0; v < NV; ++v) {
                    const vi c = vload_u8(q + KP_VW * v);
                    w0[v] = vfma(vfloat(c & 15), s[v], mn[v]);
                    w1[v] = vfma(vfloat(c >> 4), s[v], mn[v]);
                }
                const int64_t xk = k0 + 2 * r;
                for (int i = 0; i < mr; ++i) {
                    const vf a0 = vset1(xval(x, i * ldx + xk, bf));
                    const vf a1 = vset1(xval(x, i * ldx + xk + 1, bf));
                    for (int v = 0; v < NV; ++v) acc[i][v] = vfma(a0, w0[v], acc[i][v]);
                    for (int v = 0; v < NV; ++v) acc[i][v] = vfma(a1, w1[v], acc[i][v]);
                }
            }
        } else {
            const uint8_t *q = panel + 4 * NR;
            for (int64_t r = 0; r < G; ++r, q += NR) {
                vf w[NV];
                for (int v = 0; v < NV; ++v) w[v] = vload_q8(q + KP_VW * v, bits) * s[v];
                for (int i = 0; i < mr; ++i) {
                    const vf a = vset1(xval(x, i * ldx + k0 + r, bf));
                    for (int v = 0; v < NV; ++v) acc[i][v] = vfma(a, w[v], acc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV && KP_VW * v < ncols; ++v)
            ystore_n(y, i * ldy + KP_VW * v, acc[i][v], ncols - KP_VW * v, bf);
}

/* All rows of a block of x times one panel; the tail of fewer than MR rows with its own
 * constant row count so its accumulators stay in registers. */
static inline __attribute__((always_inline)) void qpanel_rows(
    const void *x, int64_t ldx, int64_t M, const uint8_t *panel, int64_t K, int64_t G,
    int64_t blk, const float *bias, void *y, int64_t ldy, int ncols, const int bits,
    const int bf) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
        qpanel_block(at(x, m * ldx, bf), ldx, panel, K, G, blk, bias,
                     (void *)at(y, m * ldy, bf), ldy, ncols, MR, bits, bf);
    const void *xm = at(x, m * ldx, bf);
    void *ym = (void *)at(y, m * ldy, bf);
    switch (M - m) {
    case 1: qpanel_block(xm, ldx, panel, K, G, blk, bias, ym, ldy, ncols, 1, bits, bf); break;
    case 2: qpanel_block(xm, ldx, panel, K, G, blk, bias, ym, ldy, ncols, 2, bits, bf); break;
    case 3: qpanel_block(xm, ldx, panel, K, G, blk, bias, ym, ldy, ncols, 3, bits, bf); break;
    default: break;
    }
}

/* One panel as fp32 weights, tile[k][j] = w[j][k]: the weights qpanel_block computes. */
static void dequant_panel(const uint8_t *panel, int64_t K, int64_t G, int64_t blk, int bits,
                          float *tile) {
    for (int64_t k0 = 0; k0 < K; k0 += G, panel += blk) {
        const float *sc = (const float *)panel;
        float *t = tile + k0 * NR;
        for (int v = 0; v < NV; ++v) {
            const vf s = vload(sc + KP_VW * v);
            if (bits == 4) {
                const vf mn = vload(sc + NR + KP_VW * v);
                const uint8_t *q = panel + 8 * NR + KP_VW * v;
                for (int64_t r = 0; r < G / 2; ++r) {
                    const vi c = vload_u8(q + r * NR);
                    vstore(t + 2 * r * NR + KP_VW * v, vfma(vfloat(c & 15), s, mn));
                    vstore(t + (2 * r + 1) * NR + KP_VW * v, vfma(vfloat(c >> 4), s, mn));
                }
            } else {
                const uint8_t *q = panel + 4 * NR + KP_VW * v;
                for (int64_t r = 0; r < G; ++r)
                    vstore(t + r * NR + KP_VW * v, vload_q8(q + r * NR, bits) * s);
            }
        }
    }
}

/* One panel as bf16 pairs in gemm_bf16.c's layout: lane j of row k2 holds w[j][2 k2] (low half)
 * and w[j][2 k2 + 1], each dequantized as dequant_panel does and rounded to bf16 once. */
static void dequant_pairs(const uint8_t *panel, int64_t K, int64_t G, int64_t blk, int bits,
                          uint32_t *tile) {
    for (int64_t k0 = 0; k0 < K; k0 += G, panel += blk) {
        const float *sc = (const float *)panel;
        uint32_t *t = tile + k0 / 2 * NR;
        for (int v = 0; v < NV; ++v) {
            const vf s = vload(sc + KP_VW * v);
            const vf mn = bits == 4 ? vload(sc + NR + KP_VW * v) : vzero();
            const uint8_t *q = panel + (bits == 4 ? 8 : 4) * NR + KP_VW * v;
            for (int64_t r = 0; r < G / 2; ++r) {
                vf w0, w1;
                if (bits == 4) {
                    const vi c = vload_u8(q + r * NR);
                    w0 = vfma(vfloat(c & 15), s, mn);
                    w1 = vfma(vfloat(c >> 4), s, mn);
                } else {
                    w0 = vload_q8(q + 2 * r * NR, bits) * s;
                    w1 = vload_q8(q + (2 * r + 1) * NR, bits) * s;
                }
                vstore((float *)(t + r * NR + KP_VW * v), (vf)vbf16_pairs(w0, w1));
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* The dot path for 4-bit and int8 codes (the avx512_bf16 and amx levels; the header says for
 * which rows): the codes become exact bf16 integers and the group's scale (and minimum) are
 * applied to fp32 partial sums, so no weight is rounded. */
#define MRQ 8 /* rows of the register block: MRQ x NV group partial sums */
#define QPF 4 /* groups between the one read and the one prefetched */

/* Entry i: the bf16 of the integer i & 15 (vpermw reads 5 bits of each index). */
static const uint16_t Q4_BF16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* 16 bytes of a code row as 16 bf16 pairs: lane j holds bf16(low nibble of byte j) in its low
 * half and bf16(high nibble) in its high half. Lane j = b | b << 12 puts the low nibble in
 * bits 0-3 of the low half (bit 4 is the high nibble's, which the table ignores) and the high
 * nibble in bits 0-3 of the high half. */
static inline __m512i q4_pairs(const uint8_t *p, __m512i table) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
}

/* Rows [0, mr) of x (at the group's first k) times one group of a panel (`bits` constant):
 * per row i and column j the partial sum P = sum_k x[i][k] q[j][k] (vdpbf16ps; each product
 * exact), then acc[i][j] += s[j] P (+ m[j] X[i] for 4 bits, X the group's sum of row i: xs,
 * one per row, `ng` apart). 4 bits: the codes converted here (codes: the group's G / 2 rows of
 * NR bytes; sc: its scales, then its minimums); 8 bits: read as pairs from wt (int8_pairs). */
static inline __attribute__((always_inline)) void qdot_block(
    const uint16_t *x, int64_t ldx, const float *xs, int64_t ng, const uint8_t *codes,
    const uint32_t *wt, int64_t G2, const float *sc, float *acc, const int mr, const int bits) {
    const __m512i table = _mm512_loadu_si512(Q4_BF16);
    vf part[MRQ][NV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV; ++v) part[i][v] = vzero();
    for (int64_t r = 0; r < G2; ++r) {
        __m512i w[NV];
        for (int v = 0; v < NV; ++v)
            w[v] = bits == 4 ? q4_pairs(codes + r * NR + KP_VW * v, table)
                             : _mm512_loadu_si512(wt + r * NR + KP_VW * v);
        for (int i = 0; i < mr; ++i) {
            uint32_t pair;
            __builtin_memcpy(&pair, x + i * ldx + 2 * r, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < NV; ++v)
                part[i][v] = _mm512_dpbf16_ps(part[i][v], a, (__m512bh)w[v]);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) { /* unrolled, so the partial sums stay in registers */
        const vf s = vload(sc + KP_VW * v);
#pragma GCC unroll 16
        for (int i = 0; i < mr; ++i) {
            float *a = acc + i * NR + KP_VW * v;
            const vf t = vfma(part[i][v], s, vload(a));
            vstore(a, bits == 4 ? vfma(vset1(xs[i * ng]), vload(sc + NR + KP_VW * v), t) : t);
        }
    }
}

/* One group's int8 codes (G rows of NR) as G / 2 rows of NR bf16 pairs in wt, each exact (an
 * int8 has at most 8 significant bits, as a bf16). */
static void int8_pairs(const uint8_t *codes, int64_t G, uint32_t *wt) {
    for (int64_t r = 0; r < G / 2; ++r)
        for (int v = 0; v < NV; ++v) {
            const uint8_t *q = codes + 2 * r * NR + KP_VW * v;
            _mm512_storeu_si512(wt + r * NR + KP_VW * v,
                                (__m512i)vbf16_pairs(vfloat(vload_i8(q)), vfloat(vload_i8(q + NR))));
        }
}

#define QDOT_TAIL(R) \
    case R: if ((R) < MRQ) qdot_block(xm, ldx, XS(m), ng, q, wt, G / 2, sc, acc + m * NR, R, bits); break;

/* Rows [0, M) of x times one panel (4 bits or int8) into y (bias: fp32 or NULL), group by
 * group: every block of MRQ rows adds its group's terms to its rows of `acc` (M x NR fp32, the
 * thread's), so the partial sums of all MRQ x NV chains, not the sums, take the registers.
 * wt: G / 2 rows of NR pairs (int8 only). */
static inline __attribute__((always_inline)) void qdot_panel(
    const uint16_t *x, int64_t ldx, int64_t M, const float *xs, int64_t ng, const uint8_t *panel,
    int64_t K, int64_t G, int64_t blk, const float *bias, uint16_t *y, int64_t ldy, int ncols,
    float *acc, uint32_t *wt, const int bits) {
    for (int64_t i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v)
            vstore(acc + i * NR + KP_VW * v, bias ? vload(bias + KP_VW * v) : vzero());
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, panel += blk, ++g) {
        const float *sc = (const float *)panel;
        const uint8_t *q = panel + (bits == 4 ? 8 : 4) * NR;
#define XS(m) (bits == 4 ? xs + (m) * ng + g : 0) /* int8: no group sums (xs NULL) */
        /* the packed weight is one stream (panels follow each other): fetch QPF groups ahead,
         * into the next panel at the end of this one (prefetching past the end cannot fault) */
        for (int64_t c = 0; c < blk; c += 64) __builtin_prefetch(panel + QPF * blk + c, 0, 3);
        if (bits == 8) int8_pairs(q, G, wt);
        int64_t m = 0;
        for (; m + MRQ <= M; m += MRQ)
            qdot_block(x + m * ldx + k0, ldx, XS(m), ng, q, wt, G / 2, sc, acc + m * NR, MRQ,
                       bits);
        const uint16_t *xm = x + m * ldx + k0;
        switch (M - m) {
        QDOT_TAIL(1) QDOT_TAIL(2) QDOT_TAIL(3) QDOT_TAIL(4) QDOT_TAIL(5) QDOT_TAIL(6) QDOT_TAIL(7)
        default: break;
        }
#undef XS
    }
    for (int64_t i = 0; i < M; ++i)
        for (int v = 0; v < NV && KP_VW * v < ncols; ++v)
            vstore_bf16_n(y + i * ldy + KP_VW * v, vload(acc + i * NR + KP_VW * v),
                          ncols - KP_VW * v);
}

/* xs[i * (K / G) + g] = the sum of row i of x over group g, in fp32. */
static void group_sums(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int64_t G,
                       float *xs) {
    for (int64_t i = 0; i < M; ++i)
        for (int64_t k0 = 0; k0 < K; k0 += G) {
            const uint16_t *xr = x + i * ldx + k0;
            int64_t k = 0;
            vf s = vzero();
            for (; k + KP_VW <= G; k += KP_VW) s += vload_bf16(xr + k);
            float t = _mm512_reduce_add_ps(s);
            for (; k < G; ++k) t += bf16_to_f32(xr[k]);
            *xs++ = t;
        }
}
#endif

/* Rows [0, mr) of x times an fp32 tile (gemm.c's register tile, without its prefetching). */
static inline __attribute__((always_inline)) void tile_block(
    const float *x, int64_t ldx, const float *tile, int64_t K, const float *bias, float *y,
    int64_t ldy, int ncols, const int mr) {
    vf acc[MRF][NV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV; ++v) {
            const int c = ncols - KP_VW * v;
            acc[i][v] = !bias || c <= 0 ? vzero()
                        : c >= KP_VW    ? vload(bias + KP_VW * v)
                                        : vload_n(bias + KP_VW * v, c);
        }
    for (int64_t k = 0; k < K; ++k) {
        vf w[NV];
        for (int v = 0; v < NV; ++v) w[v] = vload(tile + k * NR + KP_VW * v);
        for (int i = 0; i < mr; ++i) {
            const vf a = vset1(x[i * ldx + k]);
            for (int v = 0; v < NV; ++v) acc[i][v] = vfma(a, w[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < NV; ++v) {
            const int c = ncols - KP_VW * v;
            if (c >= KP_VW)
                vstore(y + i * ldy + KP_VW * v, acc[i][v]);
            else if (c > 0)
                vstore_n(y + i * ldy + KP_VW * v, acc[i][v], c);
        }
}

#define TILE_TAIL(R) \
    case R: if ((R) < MRF) tile_block(xm, ldx, tile, K, bias, ym, ldy, ncols, R); break;

static void tile_rows(const float *x, int64_t ldx, int64_t M, const float *tile, int64_t K,
                      const float *bias, float *y, int64_t ldy, int ncols) {
    int64_t m = 0;
    for (; m + MRF <= M; m += MRF)
        tile_block(x + m * ldx, ldx, tile, K, bias, y + m * ldy, ldy, ncols, MRF);
    const float *xm = x + m * ldx;
    float *ym = y + m * ldy;
    switch (M - m) {
    TILE_TAIL(1) TILE_TAIL(2) TILE_TAIL(3) TILE_TAIL(4) TILE_TAIL(5) TILE_TAIL(6) TILE_TAIL(7)
    default: break;
    }
}

/* *buf grown to at least n floats (64-byte aligned), kept between calls: a fresh allocation of a
 * tile's size is an mmap whose pages fault in on every call. NULL when memory runs out. */
static float *grown(float **buf, size_t *cap, size_t n) {
    if (*cap < n) {
        free(*buf);
        *buf = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* The calling thread's tile of at least n floats (see grown). */
static float *thread_tile(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    return grown(&buf, &cap, n);
}

#if defined(__AVX512BF16__)
/* The calling thread's buffer of at least n floats for the group sums of x (as thread_tile). */
static float *row_sums(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    return grown(&buf, &cap, n);
}
#endif

/* y = bf16 x times the packed weight (kp_quant_gemm_bf16), a team body (kp_team.h): per block
 * of rows the register path, the 4-bit dot path or the pair tile (the header says which
 * when). */
void kp_team_quant_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *packed,
                             int32_t bits, int64_t G, int64_t K, int64_t N,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const int64_t blk = kp_quant_block_bytes(bits, G);
    const int64_t panels = (N + NR - 1) / NR, panel_bytes = K / G * blk;
    for (int64_t m0 = 0; m0 < M; m0 += MB_BF16) {
        const int64_t mb = (M - m0) < MB_BF16 ? (M - m0) : MB_BF16;
        const uint16_t *xm = x + m0 * ldx;
        float *xs = 0; /* 4 bits: the group sums of x (one thread's buffer, read by all) */
        int dot = 0;    /* the dot path (4 bits with xs, int8) */
#if defined(__AVX512BF16__)
        if ((bits == 4 || bits == 8) && mb >= DOT_MIN_BF16
            && mb < (bits == 4 ? DOT_MAX_BF16 : DOT_MAX_INT8)) {
#pragma omp single copyprivate(xs, dot)
            {
                if (bits == 4 && (xs = row_sums((size_t)(mb * (K / G)))))
                    group_sums(xm, ldx, mb, K, G, xs);
                dot = bits == 8 || xs;
            }
        }
#else
        (void)xs;
#endif
        /* 4-bit dot path: mb rows of NR fp32 sums; pair tile: K / 2 rows of NR pairs */
        float *acc = dot ? thread_tile((size_t)(mb + G / 2) * NR) : 0;
        uint32_t *tile = !dot && mb >= TILE_MIN_BF16 ? (uint32_t *)thread_tile((size_t)K * NR / 2) : 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t n0 = p * NR;
            const int ncols = (N - n0) < NR ? (int)(N - n0) : NR;
            float b[NR];
            for (int c = 0; c < NR; ++c) b[c] = bias && c < ncols ? bf16_to_f32(bias[n0 + c]) : 0;
            const uint8_t *panel = packed + p * panel_bytes;
            uint16_t *ym = y + m0 * ldy + n0;
            if (acc) {
#if defined(__AVX512BF16__)
                if (bits == 4)
                    qdot_panel(xm, ldx, mb, xs, K / G, panel, K, G, blk, bias ? b : 0, ym,
                               ldy, ncols, acc + G / 2 * NR, 0, 4);
                else
                    qdot_panel(xm, ldx, mb, xs, K / G, panel, K, G, blk, bias ? b : 0, ym,
                               ldy, ncols, acc + G / 2 * NR, (uint32_t *)acc, 8);
#endif
            } else if (tile) {
                /* the next panel to L2 meanwhile (as gemm_bf16.c does for its own) */
                if (p + 1 < panels)
                    for (int64_t c = 0; c < panel_bytes; c += 64)
                        __builtin_prefetch(panel + panel_bytes + c, 0, 2);
                dequant_pairs(panel, K, G, blk, bits, tile);
                kp_bf16_panel_rows(xm, ldx, mb, tile, K / 2, bias ? b : 0, ym, ldy, ncols, 0);
            } else if (bits == 4) {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, bias ? b : 0, ym, ldy, ncols, 4, 1);
            } else if (bits == 8) {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, bias ? b : 0, ym, ldy, ncols, 8, 1);
            } else {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, bias ? b : 0, ym, ldy, ncols,
                            KP_QUANT_E4M3, 1);
            }
        }
    }
}

/* y = x times the packed weight (kp_quant_gemm_f32), a team body (kp_team.h): per block of
 * rows, the panels split over the team, each through a dequantized tile or the register path. */
void kp_team_quant_gemm_f32(const float *x, int64_t ldx, int64_t M, const uint8_t *packed,
                            int32_t bits, int64_t G, int64_t K, int64_t N, const float *bias,
                            float *y, int64_t ldy) {
    const int64_t blk = kp_quant_block_bytes(bits, G);
    const int64_t panels = (N + NR - 1) / NR, panel_bytes = K / G * blk;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = (M - m0) < MB ? (M - m0) : MB;
        /* A thread's tile: one panel, K x NR floats (no memory: the register path) */
        float *tile = mb >= TILE_MIN ? thread_tile((size_t)K * NR) : 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t n0 = p * NR;
            const int ncols = (N - n0) < NR ? (int)(N - n0) : NR;
            const float *b = bias ? bias + n0 : 0;
            const uint8_t *panel = packed + p * panel_bytes;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + n0;
            if (tile) {
                dequant_panel(panel, K, G, blk, bits, tile);
                tile_rows(xm, ldx, mb, tile, K, b, ym, ldy, ncols);
            } else if (bits == 4) {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, b, ym, ldy, ncols, 4, 0);
            } else if (bits == 8) {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, b, ym, ldy, ncols, 8, 0);
            } else {
                qpanel_rows(xm, ldx, mb, panel, K, G, blk, b, ym, ldy, ncols, KP_QUANT_E4M3, 0);
            }
        }
    }
}

int kp_quant_gemm_f32(const float *x, int64_t ldx, int64_t M, const uint8_t *packed,
                      int32_t bits, int64_t group, int64_t K, int64_t N, const float *bias,
                      float *y, int64_t ldy) {
    const int64_t blk = kp_quant_block_bytes(bits, group);
    if (blk < 0 || K <= 0 || K % group) return -1;
    if (M <= 0 || N <= 0) return 0;
#pragma omp parallel
    kp_team_quant_gemm_f32(x, ldx, M, packed, bits, group, K, N, bias, y, ldy);
    return 0;
}

int kp_quant_gemm_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *packed,
                       int32_t bits, int64_t group, int64_t K, int64_t N, const uint16_t *bias,
                       uint16_t *y, int64_t ldy) {
    const int64_t blk = kp_quant_block_bytes(bits, group);
    if (blk < 0 || K <= 0 || K % group || group % 2) return -1;
    if (M <= 0 || N <= 0) return 0;
#pragma omp parallel
    kp_team_quant_gemm_bf16(x, ldx, M, packed, bits, group, K, N, bias, y, ldy);
    return 0;
}
