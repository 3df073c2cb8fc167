/* Paged attention for rows that share keys: keys in the vector lanes (paged_attention.h).
 * The rows of one prefill chunk all read the same keys, and so do decode rows whose sequences
 * share a prompt prefix. For such a group (paged_prefix.c) the shared keys of each KV head are
 * first laid out transposed, once per call, as [head][group of 16 keys][head_dim][16]; a
 * row's scores then come out 16 keys to a vector (head_dim multiply-adds per 16 scores, no
 * horizontal sums), the softmax is taken over the whole score row (a few KiB), and the V rows
 * are read block by block. Two rows go together, so each K and V load feeds up to 6
 * (row, head) pairs with every accumulator in registers. This is markedly faster than the row
 * kernel for prefill chunks (bench/probes/prefill_attention.py). For a shared prefix (cascade)
 * the tile hands its softmax max and sum on, unnormalised, and the row kernel goes on over the
 * row's own keys from there (pa_item_avx512 with a state). */
#include "paged_attention.h"

#ifdef __AVX512F__
#include <immintrin.h>

#include "simd_exp.h"

static float *grow_buffer(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        const size_t bytes = ((size_t)n * sizeof(float) + 63) & ~(size_t)63;
        *buf = aligned_alloc(64, bytes);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* Keys t0 .. t0 + 15 (t0 a multiple of 16) of all KV heads into their places in kt (zero
 * past len). */
void pa_kt_fill(const kv_layout *kv, const int32_t *table, int32_t len, int nkv, int hd,
                int64_t ld, int32_t t0, float *kt) {
    const int32_t bs = kv->block_size;
    for (int h = 0; h < nkv; ++h) {
        float *dst = kt + (int64_t)h * hd * ld + (int64_t)t0 * hd;  /* [hd][16] for this group */
        for (int32_t t = t0; t < t0 + 16; ++t) {
            float *col = dst + (t - t0);
            if (t < len) {
                const float *src = kv->k_base + ((int64_t)table[t / bs] * bs + t % bs) * kv->tok_stride
                                   + (int64_t)h * hd;
                for (int d = 0; d < hd; ++d) col[d * 16] = src[d];
            } else {
                for (int d = 0; d < hd; ++d) col[d * 16] = 0.0f;
            }
        }
    }
}

/* Query heads g0 .. g0 + gb - 1 of KV head h for R rows (R = 2: two consecutive rows of the
 * run, sharing every K and V load) over their first lens[r] keys. M = R * gb score rows, each
 * with its own softmax; accumulators for all M stay in registers through the V loop. */
static inline __attribute__((always_inline)) void kt_tile(
    const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
    const int32_t *table, const int32_t *lens, int h, const int R, const int gb, const int NV,
    float scale, float *s, float *const *out, float *const *stats, int stats_heads) {
    const int hd = 16 * NV;
    const int M = R * gb;
    const int32_t bs = kv->block_size;
    const int32_t len = lens[R - 1] > lens[0] ? lens[R - 1] : lens[0];  /* the longer row */
    float qs[6 * 128] __attribute__((aligned(64)));
    for (int m = 0; m < M; ++m)
        for (int d = 0; d < hd; ++d) qs[m * hd + d] = q[m / gb][(int64_t)(m % gb) * hd + d] * scale;
    const float *kh = kt + (int64_t)h * hd * ld;
    const int32_t groups = (len + 15) / 16;
    for (int32_t j = 0; j < groups; ++j) {
        __m512 acc[6];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        const float *col = kh + (int64_t)j * 16 * hd;
        for (int d = 0; d < hd; ++d) {
            const __m512 k = _mm512_load_ps(col + (int64_t)d * 16);
            for (int m = 0; m < M; ++m)
                acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(qs[m * hd + d]), k, acc[m]);
        }
        for (int m = 0; m < M; ++m) _mm512_store_ps(s + m * ld + (int64_t)j * 16, acc[m]);
    }
    float inv[6];
    for (int m = 0; m < M; ++m) {
        float *sm = s + m * ld;
        const int32_t n = lens[m / gb];
        const int32_t full = n / 16 * 16;
        const __mmask16 tail = (__mmask16)((1u << (n - full)) - 1);
        __m512 vmax = _mm512_set1_ps(-3.0e38f);
        for (int32_t t = 0; t < full; t += 16) vmax = _mm512_max_ps(vmax, _mm512_load_ps(sm + t));
        if (tail) vmax = _mm512_max_ps(vmax, _mm512_mask_load_ps(vmax, tail, sm + full));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int32_t t = 0; t < full; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(sm + t), mx));
            _mm512_store_ps(sm + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        int32_t t = full;
        if (tail) {
            const __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_load_ps(sm + full), mx)));
            _mm512_store_ps(sm + full, e);
            vsum = _mm512_add_ps(vsum, e);
            t += 16;
        }
        for (; t < groups * 16; t += 16) _mm512_store_ps(sm + t, _mm512_setzero_ps());  /* keys of the longer row only */
        const float sum = _mm512_reduce_add_ps(vsum);
        if (stats) {  /* cascade: hand on the max and the sum, the output stays unnormalised */
            float *st = stats[m / gb];
            st[m % gb] = _mm512_reduce_max_ps(mx);
            st[stats_heads + m % gb] = sum;
            inv[m] = 1.0f;
        } else {
            inv[m] = 1.0f / sum;
        }
    }
    __m512 a[6][8];
    for (int m = 0; m < M; ++m)
        for (int j = 0; j < NV; ++j) a[m][j] = _mm512_setzero_ps();
    for (int32_t t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const float *base = kv->v_base + (int64_t)table[b] * bs * kv->tok_stride + (int64_t)h * hd;
        const int32_t nu = (len - t0) < bs ? (len - t0) : bs;
        for (int32_t u = 0; u < nu; ++u) {
            const float *vt = base + (int64_t)u * kv->tok_stride;
            __m512 v[8];
            for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vt + 16 * j);
            for (int m = 0; m < M; ++m) {
                const __m512 w = _mm512_set1_ps(s[m * ld + t0 + u]);
                for (int j = 0; j < NV; ++j) a[m][j] = _mm512_fmadd_ps(w, v[j], a[m][j]);
            }
        }
    }
    for (int m = 0; m < M; ++m) {
        const __m512 vi = _mm512_set1_ps(inv[m]);
        float *o = out[m / gb] + (int64_t)(m % gb) * hd;
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(a[m][j], vi));
    }
}

/* kt_tile with R, gb and the head dim as constants (registers: M * NV accumulators <= 24). */
static void kt_dispatch(const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
                        const int32_t *table, const int32_t *lens, int h, int R, int gb, int hd,
                        float scale, float *s, float *const *out, float *const *stats,
                        int stats_heads) {
#define KT(RR, GB, NV) kt_tile(q, kt, ld, kv, table, lens, h, RR, GB, NV, scale, s, out, stats, \
                               stats_heads)
    if (hd == 64) {
        if (R == 1) {
            switch (gb) { case 1: KT(1, 1, 4); break; case 2: KT(1, 2, 4); break;
                          case 3: KT(1, 3, 4); break; default: KT(1, 4, 4); break; }
        } else {
            switch (gb) { case 1: KT(2, 1, 4); break; case 2: KT(2, 2, 4); break;
                          default: KT(2, 3, 4); break; }
        }
    } else {
        if (R == 1) {
            if (gb == 1) KT(1, 1, 8); else KT(1, 2, 8);
        } else {
            KT(2, 1, 8);
        }
    }
#undef KT
}

static __thread float *kt_scores;  /* a worker's score rows */
static __thread int64_t kt_scores_cap;
static __thread float *kt_keys;  /* the calling thread's transposed keys */
static __thread int64_t kt_keys_cap;

/* KV heads kvh .. kvh + nkv - 1 of R (1 or 2) consecutive rows of a prefill run; q[r] and
 * out[r] point at the first of their heads. */
int pa_kt_item(const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
               const int32_t *table, const int32_t *lens, int R, int kvh, int nkv, int group,
               int hd, float scale, float *const *out, float *const *stats) {
    const int per_pass = hd == 64 ? (R == 1 ? 4 : 3) : (R == 1 ? 2 : 1);
    float *s = grow_buffer(&kt_scores, &kt_scores_cap, (int64_t)6 * ld);
    if (!s) return -1;
    for (int k = 0; k < nkv; ++k)
        for (int g = 0; g < group; g += per_pass) {
            const int gb = (group - g) < per_pass ? (group - g) : per_pass;
            const int64_t off = ((int64_t)k * group + g) * hd;
            const float *qg[2] = {q[0] + off, R > 1 ? q[1] + off : 0};
            float *og[2] = {out[0] + off, R > 1 ? out[1] + off : 0};
            if (stats) {  /* [m, l per head][acc]: heads of this pass at their offsets */
                const int heads = nkv * group, hh = k * group + g;
                float *sg[2] = {stats[0] + hh, R > 1 ? stats[1] + hh : 0};
                float *ag[2] = {stats[0] + 2 * heads + off, R > 1 ? stats[1] + 2 * heads + off : 0};
                kt_dispatch(qg, kt, ld, kv, table, lens, kvh + k, R, gb, hd, scale, s, ag, sg,
                            heads);
            } else {
                kt_dispatch(qg, kt, ld, kv, table, lens, kvh + k, R, gb, hd, scale, s, og, 0, 0);
            }
        }
    return 0;
}

float *pa_transposed_keys(int64_t n) { return grow_buffer(&kt_keys, &kt_keys_cap, n); }
#endif
