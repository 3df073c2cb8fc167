/* The vector layer every native kernel is written over: one source for every level of
 * kernels/kserve_paged_kernels/cpu_native/isa.py.
 *
 * Why: the kernels were AVX-512 intrinsics, compiled out on AVX2 machines, so those ran
 * projections through oneDNN, had no one-call decoder stack and sent prefill attention to SDPA.
 * Here `vf` is a GCC vector of KP_VW floats (8 on AVX2, 16 with AVX-512), so arithmetic is
 * plain C operators (a + b, a * s); the few operations C cannot say (FMA, max, rounding,
 * masked tails, horizontal sums) are one small function each, with an intrinsic per width.
 * KP_VREGS, the register file's size, lets a kernel pick its blocking per level.
 *
 * Only what the kernels use is here; every function is a static inline over registers.
 */
#ifndef KP_VEC_H
#define KP_VEC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define KP_VW 16
#define KP_VREGS 32
typedef __m512 vf;
#elif defined(__AVX2__) && defined(__FMA__)
#define KP_VW 8
#define KP_VREGS 16
typedef __m256 vf;
#else
#error "the native kernels need AVX2 and FMA at least (kernels/kserve_paged_kernels/cpu_native/isa.py, level avx2)"
#endif

/* Lanes as 32-bit integers (comparison results: -1 true, 0 false). */
typedef int32_t vi __attribute__((vector_size(4 * KP_VW)));
/* A vf at any float address (unaligned, may alias the floats around it). */
typedef float vf_unaligned __attribute__((vector_size(4 * KP_VW), aligned(4), may_alias));

static inline vf vzero(void) { return (vf){0}; }
static inline vf vset1(float s) { return vzero() + s; }
static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }
static inline void vstore(float *p, vf v) { *(vf_unaligned *)p = v; }

/* Lane indices 0 .. KP_VW - 1. */
static inline vi viota(void) {
#if KP_VW == 16
    return (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (vi){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}

/* -1 in lanes below n, 0 from lane n on. */
static inline vi vlanes_below(int n) { return viota() < n; }

/* mask ? a : b, lane by lane (mask lanes all ones or all zeros). */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* The first n lanes (0 <= n <= KP_VW) from p, zeros after; nothing past p + n is read. */
static inline vf vload_n(const float *p, int n) {
#if KP_VW == 16
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
    return _mm256_maskload_ps(p, (__m256i)vlanes_below(n));
#endif
}

/* The first n lanes of v to p; nothing past p + n is written. */
static inline void vstore_n(float *p, vf v, int n) {
#if KP_VW == 16
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
#else
    _mm256_maskstore_ps(p, (__m256i)vlanes_below(n), v);
#endif
}

/* a * b + c, one rounding. */
static inline vf vfma(vf a, vf b, vf c) {
#if KP_VW == 16
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm256_fmadd_ps(a, b, c);
#endif
}

static inline vf vmax(vf a, vf b) {
#if KP_VW == 16
    return _mm512_max_ps(a, b);
#else
    return _mm256_max_ps(a, b);
#endif
}

static inline vf vmin(vf a, vf b) {
#if KP_VW == 16
    return _mm512_min_ps(a, b);
#else
    return _mm256_min_ps(a, b);
#endif
}

/* Round to the nearest integer (ties to even), as floats. */
static inline vf vround(vf a) {
#if KP_VW == 16
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

/* Sum and maximum of the lanes. */
static inline float vhsum(vf v) {
#if KP_VW == 16
    return _mm512_reduce_add_ps(v);
#else
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

static inline float vhmax(vf v) {
#if KP_VW == 16
    return _mm512_reduce_max_ps(v);
#else
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
#endif
}

/* Lane i of the result = the sum of the lanes of v[i], for KP_VW vectors at once: a
 * transpose-and-add tree (a handful of shuffles per vector instead of a full horizontal
 * sum each). */
static inline vf vhsum_lanes(const vf v[KP_VW]) {
#if KP_VW == 16
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
#else
    __m256 x[4], y[2];
    for (int i = 0; i < 4; ++i)
        x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
        y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    /* y[0]: sums of vectors 0-3 over their low 128 bits, then over their high 128 bits;
     * y[1]: the same for vectors 4-7. */
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                         _mm256_permute2f128_ps(y[0], y[1], 0x31));
#endif
}

/* e^x per lane: 2^(x log2 e) split into 2^n (vscalefps, or built in the exponent bits on AVX2)
 * times a degree-6 polynomial for 2^f, |f| <= 0.5 (relative error ~1e-7 near 0, where the
 * softmax weights that matter are). Inputs are clamped to [-87, 88]: weights below e^-87 are
 * zero in fp32 sums anyway, and e^88 is finite (SiLU's sigmoid of a large negative input is
 * then ~0, not NaN). */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    const vf t = x * 1.44269504088896341f;
    const vf n = vround(t);
    const vf f = t - n;
    vf y = vset1(1.5403530393381608e-4f);
    y = vfma(y, f, vset1(1.3333558146428443e-3f));
    y = vfma(y, f, vset1(9.6181291076284772e-3f));
    y = vfma(y, f, vset1(5.5504108664821580e-2f));
    y = vfma(y, f, vset1(2.4022650695910071e-1f));
    y = vfma(y, f, vset1(6.9314718055994531e-1f));
    y = vfma(y, f, vset1(1.0f));
#if KP_VW == 16
    return _mm512_scalef_ps(y, n);  /* y * 2^n in one instruction */
#else
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;  /* 2^n, -126 <= n <= 127 */
    return y * (vf)scale;
#endif
}

#endif
