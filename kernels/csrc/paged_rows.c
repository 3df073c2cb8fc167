/* Paged attention, the row kernel: one query row at a time (paged_attention.h).
 *
 * Work item = (row, KV head) or, with many rows, the whole row: the query heads sharing a KV
 * head are processed together, so each K/V row is loaded once for the group. The context is
 * walked in chunks of CHUNK keys: scores for the chunk, one vectorised exp pass and one rescale
 * of the running sum and accumulator (online softmax), then the weighted V rows, while the next
 * chunk is prefetched. Consecutive rows of one prefill sequence re-read the same K/V, which
 * stays in cache. With AVX-512, head dims 64 and 128 get hand-vectorised copies (q and the
 * accumulators in registers); every other case uses the portable loop. CHUNK = 32 measured
 * best for the prefetch distance, against 16, 64 and 128.
 */
#include "paged_attention.h"

/* Online-softmax bookkeeping for one head over a chunk of n scores in p (replaced by their
 * weights exp(s - new max)); returns the factor that rescales the old accumulator. */
static inline float softmax_chunk(float *p, int n, float *m, float *l) {
    float mx = *m;
    for (int t = 0; t < n; ++t) mx = p[t] > mx ? p[t] : mx;
    const float corr = (*m == -INFINITY) ? 0.0f : expf(*m - mx);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) {
        const float e = expf(p[t] - mx);
        p[t] = e;
        sum += e;
    }
    *l = *l * corr + sum;
    *m = mx;
    return corr;
}

/* Portable version: any head_dim up to MAX_HEAD_DIM, keys start .. len - 1 (a sliding window
 * starts past 0); softcap > 0 caps each scaled score s to softcap * tanh(s / softcap). */
void pa_item_generic(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                     int32_t len, int kvh, int group, int hd, float scale, float softcap,
                     float *out) {
    float qs[MAX_GROUP * MAX_HEAD_DIM];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float p[MAX_GROUP * CHUNK];
    float m[MAX_GROUP], l[MAX_GROUP];
    const float *krow[CHUNK];
    const float *vrow[CHUNK];
    for (int g = 0; g < group; ++g) {
        for (int d = 0; d < hd; ++d) {
            qs[g * hd + d] = q[g * hd + d] * scale;
            acc[g * hd + d] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (int32_t c0 = start; c0 < len; c0 += CHUNK) {
        const int n = (len - c0) < CHUNK ? (len - c0) : CHUNK;
        chunk_rows(kv, table, c0, n, kvh, hd, krow, vrow);
        for (int g = 0; g < group; ++g) {
            const float *qg = qs + g * hd;
            float *pg = p + g * CHUNK;
            for (int t = 0; t < n; ++t) {
                const float *kt = krow[t];
                float s = 0.0f;
                for (int d = 0; d < hd; ++d) s += qg[d] * kt[d];
                pg[t] = s;
            }
            if (softcap > 0.0f)
                for (int t = 0; t < n; ++t) pg[t] = softcap * tanhf(pg[t] * inv_cap);
            const float corr = softmax_chunk(pg, n, &m[g], &l[g]);
            float *ag = acc + g * hd;
            for (int d = 0; d < hd; ++d) ag[d] *= corr;
            for (int t = 0; t < n; ++t) {
                const float w = pg[t];
                const float *vt = vrow[t];
                for (int d = 0; d < hd; ++d) ag[d] += w * vt[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < hd; ++d) out[g * hd + d] = acc[g * hd + d] * inv;
    }
}

/* Pull `nfl` floats at each of the n rows toward L2 (prefetcht1): the rows sit in scattered
 * blocks, which the hardware prefetchers cannot guess, and the loops over them would
 * otherwise stall on every new row. */
static inline void prefetch_l2(const float *const *rows, int n, int64_t nfl) {
    for (int t = 0; t < n; ++t)
        for (int64_t b = 0; b < nfl; b += 16) __builtin_prefetch(rows[t] + b, 0, 2);
}

#ifdef __AVX512F__
#include <immintrin.h>

#include "simd_exp.h"

/* Lane i of the result = sum of all 16 lanes of v[i]: a transpose-and-add tree (45 shuffles
 * and adds for 16 sums instead of 16 separate horizontal reductions). */
static inline __m512 hsum16(const __m512 v[16]) {
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
}
/* softmax_chunk for n <= 32 scores, all in registers: no scalar passes over the chunk. */
_Static_assert(CHUNK <= 32, "softmax_chunk_avx512 holds a chunk in two registers");
static inline float softmax_chunk_avx512(float *p, int n, float *m, float *l) {
    const __mmask16 k0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    const __mmask16 k1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    const __m512 lowest = _mm512_set1_ps(-3.0e38f);
    const __m512 s0 = _mm512_mask_loadu_ps(lowest, k0, p);
    const __m512 s1 = _mm512_mask_loadu_ps(lowest, k1, p + 16);
    const float cmax = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float mx = cmax > *m ? cmax : *m;
    const float corr = (*m == -INFINITY) ? 0.0f : expf(*m - mx);
    const __m512 vmx = _mm512_set1_ps(mx);
    const __m512 e0 = _mm512_maskz_mov_ps(k0, exp512(_mm512_sub_ps(s0, vmx)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1, exp512(_mm512_sub_ps(s1, vmx)));
    _mm512_mask_storeu_ps(p, k0, e0);
    _mm512_mask_storeu_ps(p + 16, k1, e1);
    *l = *l * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
    *m = mx;
    return corr;
}

/* AVX-512 version for head_dim = 16 * NV. Per chunk of keys and per KV head, the query heads of
 * the group are taken a few at a time (`gb`, a compile-time constant so q and the accumulators
 * stay in registers): each K row and each V row is loaded once for all of them. While a chunk
 * is processed, the next chunk's K and V rows are prefetched toward L2, a few lines per key, so
 * the memory system keeps fetching the scattered blocks while the core computes (measurably
 * faster than the loop before it, which stalled on every new block). */
#define PASS_MAX 4
static inline __attribute__((always_inline)) void pass_avx512(
    const float *q, const int gb, const int NV, const float *const *krow,
    const float *const *vrow, const float *const *nkrow, const float *const *nvrow, int n,
    int nnext, int64_t koff, float scale, float *p, float *m, float *l, float *accbuf) {
    const int hd = 16 * NV;
    __m512 qv[PASS_MAX][8];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int i = 0; i < gb; ++i)
        for (int j = 0; j < NV; ++j) qv[i][j] = _mm512_mul_ps(_mm512_loadu_ps(q + i * hd + 16 * j), vscale);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        __m512 part[PASS_MAX][16];
        for (int u = 0; u < 16; ++u) {
            const float *kt = krow[t + u] + koff;
            __m512 k[8];
            for (int j = 0; j < NV; ++j) k[j] = _mm512_loadu_ps(kt + 16 * j);
            for (int i = 0; i < gb; ++i) {
                __m512 s = _mm512_mul_ps(qv[i][0], k[0]);
                for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(qv[i][j], k[j], s);
                part[i][u] = s;
            }
        }
        for (int i = 0; i < gb; ++i) _mm512_storeu_ps(p + i * CHUNK + t, hsum16(part[i]));
    }
    for (; t < n; ++t) {
        const float *kt = krow[t] + koff;
        for (int i = 0; i < gb; ++i) {
            __m512 s = _mm512_mul_ps(qv[i][0], _mm512_loadu_ps(kt));
            for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(qv[i][j], _mm512_loadu_ps(kt + 16 * j), s);
            p[i * CHUNK + t] = _mm512_reduce_add_ps(s);
        }
    }
    __m512 a[PASS_MAX][8];
    for (int i = 0; i < gb; ++i) {
        const __m512 corr = _mm512_set1_ps(softmax_chunk_avx512(p + i * CHUNK, n, &m[i], &l[i]));
        for (int j = 0; j < NV; ++j) a[i][j] = _mm512_mul_ps(_mm512_loadu_ps(accbuf + i * hd + 16 * j), corr);
    }
    for (int u = 0; u < n; ++u) {
        if (u < nnext) {
            for (int b = 0; b < hd; b += 16) {
                __builtin_prefetch(nkrow[u] + koff + b, 0, 2);
                __builtin_prefetch(nvrow[u] + koff + b, 0, 2);
            }
        }
        const float *vt = vrow[u] + koff;
        __m512 v[8];
        for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vt + 16 * j);
        for (int i = 0; i < gb; ++i) {
            const __m512 w = _mm512_set1_ps(p[i * CHUNK + u]);
            for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(w, v[j], a[i][j]);
        }
    }
    for (int i = 0; i < gb; ++i)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(accbuf + i * hd + 16 * j, a[i][j]);
}

/* One pass over a chunk for `gb` query heads of one KV head; gb is dispatched to a constant so
 * pass_avx512 is specialised per count. */
#define DEFINE_PASS(NAME, NV)                                                                   \
    static void NAME(const float *q, int gb, const float *const *krow,                         \
                     const float *const *vrow, const float *const *nkrow,                       \
                     const float *const *nvrow, int n, int nnext, int64_t koff, float scale,    \
                     float *p, float *m, float *l, float *accbuf) {                             \
        switch (gb) {                                                                           \
        case 1: pass_avx512(q, 1, NV, krow, vrow, nkrow, nvrow, n, nnext, koff, scale, p, m, l, accbuf); break; \
        case 2: pass_avx512(q, 2, NV, krow, vrow, nkrow, nvrow, n, nnext, koff, scale, p, m, l, accbuf); break; \
        case 3: pass_avx512(q, 3, NV, krow, vrow, nkrow, nvrow, n, nnext, koff, scale, p, m, l, accbuf); break; \
        default: pass_avx512(q, 4, NV, krow, vrow, nkrow, nvrow, n, nnext, koff, scale, p, m, l, accbuf); break; \
        }                                                                                       \
    }
DEFINE_PASS(pass_hd64, 4)
DEFINE_PASS(pass_hd128, 8)

/* KV heads kvh .. kvh + nkv - 1 of one row (q and out at the first of their query heads). */
/* Keys start .. len - 1; with `state` (m, l per head, then the unnormalised accumulators
 * [heads][hd]) the online softmax goes on from there instead of from nothing: how a row's
 * own keys follow a shared prefix done elsewhere (cascade). */
void pa_item_avx512(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                    int32_t len, int kvh, int nkv, int group, int hd, float scale,
                    const float *state, float *out) {
    const int heads = nkv * group;
    const int per_pass = hd == 64 ? 4 : 2;  /* hd 128: 2 heads x 8 vectors of q fit registers */
    float accbuf[MAX_HEADS * MAX_HEAD_DIM];
    float p[PASS_MAX * CHUNK];
    float m[MAX_HEADS], l[MAX_HEADS];
    const float *rows[4][CHUNK];  /* K and V pointers of this chunk and of the next */
    int cur = 0;
    for (int g = 0; g < heads; ++g) {
        m[g] = state ? state[g] : -INFINITY;
        l[g] = state ? state[heads + g] : 0.0f;
    }
    for (int64_t i = 0; i < (int64_t)heads * hd; ++i)
        accbuf[i] = state ? state[2 * heads + i] : 0.0f;
    const int32_t first = len - start < CHUNK ? len - start : CHUNK;
    const int n0 = first > 0 ? first : 0;
    chunk_rows(kv, table, start, n0, kvh, hd, rows[0], rows[1]);
    prefetch_l2(rows[0], n0, (int64_t)nkv * hd);
    prefetch_l2(rows[1], n0, (int64_t)nkv * hd);
    for (int32_t c0 = start; c0 < len; c0 += CHUNK) {
        const int n = (len - c0) < CHUNK ? (len - c0) : CHUNK;
        const float *const *krow = rows[2 * cur], *const *vrow = rows[2 * cur + 1];
        const float **nk = rows[2 * (1 - cur)], **nv = rows[2 * (1 - cur) + 1];
        const int32_t c1 = c0 + CHUNK;
        const int nnext = c1 < len ? ((len - c1) < CHUNK ? (len - c1) : CHUNK) : 0;
        if (nnext) chunk_rows(kv, table, c1, nnext, kvh, hd, nk, nv);
        for (int h = 0; h < nkv; ++h) {
            const int64_t koff = (int64_t)h * hd;
            for (int g = 0; g < group; g += per_pass) {
                const int gb = (group - g) < per_pass ? (group - g) : per_pass;
                const int head = h * group + g;
                /* The first pass over this KV head prefetches its slice of the next chunk's
                 * rows (prefetching whole rows in one pass measured slower). */
                const int pf = g == 0 ? nnext : 0;
                if (hd == 64)
                    pass_hd64(q + (int64_t)head * hd, gb, krow, vrow, nk, nv, n, pf, koff, scale,
                              p, m + head, l + head, accbuf + (int64_t)head * hd);
                else
                    pass_hd128(q + (int64_t)head * hd, gb, krow, vrow, nk, nv, n, pf, koff,
                               scale, p, m + head, l + head, accbuf + (int64_t)head * hd);
            }
        }
        cur = 1 - cur;
    }
    for (int g = 0; g < heads; ++g) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int j = 0; j < hd; j += 16)
            _mm512_storeu_ps(out + (int64_t)g * hd + j,
                             _mm512_mul_ps(_mm512_loadu_ps(accbuf + (int64_t)g * hd + j), inv));
    }
}
#endif
