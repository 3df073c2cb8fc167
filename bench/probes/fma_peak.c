/* FMA peak probe for bench/probes/fma_peak.py: 12 independent chains of AVX-512 fused
 * multiply-adds per thread, enough to cover the FMA latency, so the loop runs at the units'
 * throughput. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

int main(void) {
    const long iters = 200000000;
    float res = 0.0f;
    const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : res)
    {
        __m512 a0 = _mm512_set1_ps(0.1f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
               a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
        const long n = iters / omp_get_num_threads();
        for (long it = 0; it < n; ++it) {
#define F(x) x = _mm512_fmadd_ps(x, b, c);
            F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
            /* keep every chain in a register (no spills, no folding) */
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                 _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
        s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
        res += _mm512_reduce_add_ps(s);
    }
    const double dt = omp_get_wtime() - t0;
    printf("%d threads: %.1f GFLOP/s fp32 (checksum %g)\n", omp_get_max_threads(),
           iters * 12.0 * 32 / dt / 1e9, res);
    return 0;
}
