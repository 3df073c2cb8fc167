/* bfloat16 <-> fp32 for the bf16 kernels (paged_bf16.c, cpu_ops_bf16.c), every level.
 *
 * A bf16 is the top half of an fp32, so widening is exact: zero-extend the 16 bits and shift
 * them up. Narrowing rounds to nearest even, as torch's `.to(torch.bfloat16)` does. */
#ifndef KP_BF16_H
#define KP_BF16_H

#include <stdint.h>

#include "kp_vec.h"

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

/* Round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

/* KP_VW bf16 values from p, widened to fp32. */
static inline vf vload_bf16(const uint16_t *p) {
#if KP_VW == 16
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

/* Lanes as unsigned 32-bit integers (bf16 pairs, rounding by bit arithmetic). */
typedef uint32_t vu __attribute__((vector_size(4 * KP_VW)));

/* 2 * KP_VW bf16 values from p, widened in their pairs' order: even[j] = p[2j], odd[j] =
 * p[2j + 1] (no shuffle: a shift and a mask of the 32-bit lanes). */
typedef uint32_t vu_unaligned __attribute__((vector_size(4 * KP_VW), aligned(2), may_alias));
static inline void vload_bf16_eo(const uint16_t *p, vf *even, vf *odd) {
    const vu u = *(const vu_unaligned *)p;
    *even = (vf)(u << 16);
    *odd = (vf)(u & 0xffff0000u);
}

/* v rounded to bf16 lane by lane (nearest even, NaN kept quiet: f32_to_bf16's rule), the bf16 in
 * the high half of each lane and zeros in the low half. */
static inline vu vbf16_hi(vf v) {
    const vu u = (vu)v;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu r = ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | ((u | 0x400000u) & nan);
    return r & 0xffff0000u;
}

/* bf16 pairs from two vectors: lane j holds w0[j] rounded (low half) and w1[j] rounded (high
 * half), nearest even (the pair layout of gemm_bf16.c's packed weights). With AVX512-BF16 one
 * conversion and one permute (that conversion reads fp32 denormals as zero, as the bf16 dot
 * product does anyway); elsewhere vbf16_hi twice. */
static inline vu vbf16_pairs(vf w0, vf w1) {
#if defined(__AVX512BF16__)
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  /* w0 in elements 0-15 */
    return (vu)_mm512_permutexvar_epi16(_mm512_loadu_si512(order), h);
#else
    return (vbf16_hi(w0) >> 16) | vbf16_hi(w1);
#endif
}

/* vload_bf16_eo's inverse: even and odd rounded to bf16 (vbf16_hi) and stored interleaved,
 * 2 * KP_VW values at p. */
static inline void vstore_bf16_eo(uint16_t *p, vf even, vf odd) {
    *(vu_unaligned *)p = (vbf16_hi(even) >> 16) | vbf16_hi(odd);
}

/* v rounded to bf16 (vbf16_hi), the first n lanes stored at p. */
static inline void vstore_bf16_n(uint16_t *p, vf v, int n) {
    const vu r = vbf16_hi(v) >> 16;
#if KP_VW == 16
    const __m256i h = _mm512_cvtepi32_epi16((__m512i)r);
    if (n >= 16)
        _mm256_storeu_si256((__m256i *)p, h);
    else
        _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), h);
#else
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128((__m256i)r),
                                       _mm256_extracti128_si256((__m256i)r, 1));
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, h);
    } else {
        uint16_t tmp[8];
        _mm_storeu_si128((__m128i *)tmp, h);
        for (int i = 0; i < n; ++i) p[i] = tmp[i];
    }
#endif
}

/* gemm_bf16.c's register tile: rows [0, M) of bf16 x times one pair-packed panel (K2 rows of
 * KP_GEMM_PANEL pairs), fp32 sums from `bias` (fp32, NULL: zeros), rounded into y's first
 * `ncols` columns; `next_panel` (or NULL) is prefetched meanwhile. The one home of that
 * micro-kernel, shared with quant_gemm.c's bf16 tiles; internal to the library (no KP_API). */
void kp_bf16_panel_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint32_t *panel,
                        int64_t K2, const float *bias, uint16_t *y, int64_t ldy, int ncols,
                        const uint32_t *next_panel);

#endif
