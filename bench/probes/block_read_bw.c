/* Read-bandwidth probe for bench/probes/block_read_bw.py. */
#include <stdint.h>
#include <immintrin.h>
/* Sum every float of the listed blocks (each blk_floats long), 2 threads, AVX-512. */
float sum_blocks(const float *base, const int32_t *ids, int64_t n, int64_t blk_floats) {
    float total = 0.0f;
#pragma omp parallel for reduction(+:total) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        const float *b = base + (int64_t)ids[i] * blk_floats;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t j = 0; j < blk_floats; j += 64) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(b + j));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(b + j + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(b + j + 32));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(b + j + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    return total;
}
