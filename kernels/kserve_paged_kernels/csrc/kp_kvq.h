/* One-byte KV codes (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2) <-> fp32, every level: what
 * the quantized-KV kernels share (kv_q8.c: the store; paged_q8.c: attention).
 *
 * The value of a code is code * scale (kernels/kserve_paged_kernels/kv_quant.py). Widening is exact and cheap:
 * - int8: sign-extend and convert;
 * - fp8_e5m2: the byte is the top half of an IEEE half, so `byte << 8` is that half, which
 *   F16C (vcvtph2ps, every level has it) widens exactly;
 * - fp8_e4m3 (the `fn` variant: no infinities): `(byte & 0x7f) << 7` with the sign at bit 15
 *   is a half whose exponent field is e4m3's and whose value is 2^-8 of the code's, normal
 *   and subnormal codes alike, so the widened half times 256 is exact. The kernels fold the
 *   256 into the scale (kvq_unit). The two NaN codes (0x7f, 0xff) read as +-480; the store
 *   never writes them (it clamps to +-448).
 * Narrowing (the store) rounds to nearest, ties to even, as torch's casts do.
 */
#ifndef KP_KVQ_H
#define KP_KVQ_H

#include <math.h>
#include <stdint.h>

#include "kp_native.h"
#include "kp_vec.h"

/* The largest code of each format: the scale of a (block, head) is its largest |x| over it. */
static inline float kvq_qmax(int fmt) {
    return fmt == KP_KV_INT8 ? 127.0f : fmt == KP_KV_E4M3 ? 448.0f : 57344.0f;
}

/* What the widened code must be multiplied by besides the scale (e4m3's 2^8, above). */
static inline float kvq_unit(int fmt) { return fmt == KP_KV_E4M3 ? 256.0f : 1.0f; }

/* One code to fp32 (times kvq_unit(fmt) to be its value): the scalar tails. */
static inline float kvq_widen1(uint8_t b, int fmt) {
    if (fmt == KP_KV_INT8) return (float)(int8_t)b;
    const uint16_t h = fmt == KP_KV_E5M2 ? (uint16_t)(b << 8)
                                         : (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    return _cvtsh_ss(h);
}

/* KP_VW codes from p widened (times kvq_unit(fmt) to be their values). */
static inline vf kvq_widen(const uint8_t *p, int fmt) {
#if KP_VW == 16
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (fmt == KP_KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h = fmt == KP_KV_E5M2
        ? _mm256_slli_epi16(w, 8)
        : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                          _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
#else
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (fmt == KP_KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i h = fmt == KP_KV_E5M2
        ? _mm_slli_epi16(w, 8)
        : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                       _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
#endif
}

/* n codes to fp32 times `mul` (scale * kvq_unit, or kvq_unit alone). */
static inline void kvq_widen_row(const uint8_t *src, float *dst, int n, int fmt, float mul) {
    int d = 0;
    switch (fmt) {  /* the format a constant inside each loop */
    case KP_KV_INT8:
        for (; d + KP_VW <= n; d += KP_VW) vstore(dst + d, kvq_widen(src + d, KP_KV_INT8) * mul);
        break;
    case KP_KV_E4M3:
        for (; d + KP_VW <= n; d += KP_VW) vstore(dst + d, kvq_widen(src + d, KP_KV_E4M3) * mul);
        break;
    default:
        for (; d + KP_VW <= n; d += KP_VW) vstore(dst + d, kvq_widen(src + d, KP_KV_E5M2) * mul);
        break;
    }
    for (; d < n; ++d) dst[d] = kvq_widen1(src[d], fmt) * mul;
}

#endif
