/* Vector e^x shared by the kernels (AVX-512 builds only). */
#ifndef KP_SIMD_EXP_H
#define KP_SIMD_EXP_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for 16 lanes: 2^(x log2 e) split into 2^n (vscalefps) times a degree-6 polynomial for
 * 2^f, |f| <= 0.5 (relative error ~1e-7 near 0, where the softmax weights that matter are).
 * Inputs are clamped at -87 (weights below e^-87 are zero in fp32 sums anyway). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.5403530393381608e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#endif
#endif
