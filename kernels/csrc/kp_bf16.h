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

#endif
