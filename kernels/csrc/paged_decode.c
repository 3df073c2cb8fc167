/* Paged attention on CPU, fp32, one query row at a time, read straight from the paged KV cache.
 * The PyTorch path has to gather each sequence's blocks into a contiguous copy before attention
 * (write the copy, read it again); this reads every K/V row once per query row.
 *
 * A query row is a new token: a decode token, or one token of a prefill chunk. Each row has its
 * own context length (a prefill token at position p sees p + 1 keys), which is how causality is
 * expressed, so prefill and decode rows go through the same loop. Consecutive rows of one
 * prefill sequence re-read the same K/V, which stays in cache.
 *
 * Work item = (row, KV head) or, with many rows, the whole row: the query heads sharing a KV
 * head are processed together, so each K/V row is loaded once for the group. The context is
 * walked in chunks of CHUNK keys: scores for the chunk, one vectorised exp pass and one rescale
 * of the running sum and accumulator (online softmax), then the weighted V rows, while the next
 * chunk is prefetched. Items are spread over OpenMP threads. With AVX-512, head dims 64 and 128
 * get hand-vectorised copies (q and the accumulators in registers); every other case uses the
 * portable loop. CHUNK = 32 measured best for the prefetch distance (64 x 400-key rows on 2
 * cores: 1.7 ms against 1.9-2.0 ms with 16, 64 or 128).
 *
 * Layout (architecture.md): kv = [2, num_blocks, block_size, num_kv_heads, head_dim].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 32
#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define CHUNK 32

#ifdef _OPENMP
#include <omp.h>
void kp_set_threads(int n) { if (n > 0) omp_set_num_threads(n); }
#else
void kp_set_threads(int n) { (void)n; }
#endif

typedef struct {
    const float *k_base, *v_base;
    int64_t tok_stride;
    int32_t block_size;
} kv_layout;

/* Chunk-local pointers to the K and V rows of keys c0 .. c0 + n - 1 for KV head kvh. */
static inline void chunk_rows(const kv_layout *kv, const int32_t *table, int32_t c0, int n,
                              int kvh, int hd, const float **krow, const float **vrow) {
    const int32_t bs = kv->block_size;
    for (int t = 0; t < n; ++t) {
        const int32_t pos = c0 + t;
        const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * kv->tok_stride
                            + (int64_t)kvh * hd;
        krow[t] = kv->k_base + off;
        vrow[t] = kv->v_base + off;
    }
}

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

/* Portable version: any head_dim up to MAX_HEAD_DIM. */
static void item_generic(const float *q, const kv_layout *kv, const int32_t *table, int32_t len,
                         int kvh, int group, int hd, float scale, float *out) {
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
    for (int32_t c0 = 0; c0 < len; c0 += CHUNK) {
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
 * the memory system keeps fetching the scattered blocks while the core computes (64 rows x
 * 400 keys on 2 cores: 13.5 M keys/s, against 9.8 M for the previous loop, which stalled on
 * every new block). */
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
static void item_avx512(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
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

/* ---- Rows that share keys: keys in the vector lanes ----
 * The rows of one prefill chunk all read the same keys, and so do decode rows whose sequences
 * share a prompt prefix. For such a group (see kp_paged_rows_f32) the shared keys of each KV
 * head are first laid out transposed, once per call, as [head][group of 16 keys][head_dim][16];
 * a row's scores then come out 16 keys to a vector (head_dim multiply-adds per 16 scores, no
 * horizontal sums), the softmax is taken over the whole score row (a few KiB), and the V rows
 * are read block by block. Two rows go together, so each K and V load feeds up to 6
 * (row, head) pairs with every accumulator in registers. On 7 prompts of 64-512 tokens (a W1
 * prefill step, 9 heads over 3 KV heads, 2 threads): 10.8 -> 7.2 ms a layer; one 2048-token
 * prompt: 54 -> 29 ms (bench/probes/prefill_attention.py). For a shared prefix (cascade) the
 * tile hands its softmax max and sum on, unnormalised, and the row loop above goes on over the
 * row's own keys from there: 64 decode rows over a 400-token prefix plus 32-96 own tokens,
 * 0.84 -> 0.55 ms a layer. */
#ifndef CASCADE_MIN_ROWS
#define CASCADE_MIN_ROWS 8
#endif
#ifndef CASCADE_MIN_BLOCKS
#define CASCADE_MIN_BLOCKS 8
#endif
#ifndef KT_MIN_ROWS  /* a huge value turns the path off (bench/probes/prefill_attention.py) */
#define KT_MIN_ROWS 32
#endif

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
static void kt_fill(const kv_layout *kv, const int32_t *table, int32_t len, int nkv, int hd,
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
static int kt_item(const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
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
#endif

/* Rows first .. last share their first `keys` keys, laid out transposed from kt + off with
 * `ld` (keys rounded up to 16) keys per head dimension. */
typedef struct {
    int64_t first, last, off, ld;
    int32_t keys;
    int cascade;
} key_group;

#ifdef __AVX512F__
/* The groups of rows that share keys, in row order; group_of[r] gets each row's group or -1:
 * - prefill runs: at least KT_MIN_ROWS rows of one sequence at consecutive positions (all
 *   keys of the run's last row);
 * - with `cascade`, among the other rows: at least CASCADE_MIN_ROWS consecutive rows of
 *   different sequences whose block tables start with the same CASCADE_MIN_BLOCKS or more full
 *   blocks (a shared prompt prefix; the full blocks before each row's last key). The prefix is
 *   done once per group, two rows at a time; each row then goes on over its own keys from the
 *   softmax state the prefix left. */
static int64_t find_key_groups(const int32_t *row_lens, const int64_t *seq_idx,
                               const int32_t *block_tables, int64_t bt_stride, int32_t bs,
                               int64_t n, int cascade, int32_t *group_of, key_group *grp) {
    int64_t groups = 0;
    for (int64_t i = 0; i < n; ++i) group_of[i] = -1;
    for (int64_t r = 0; r < n;) {
        int64_t e = r + 1;
        while (e < n && seq_idx[e] == seq_idx[r] && row_lens[e] == row_lens[e - 1] + 1) ++e;
        if (e - r >= KT_MIN_ROWS) {
            grp[groups] = (key_group){r, e - 1, 0, 0, row_lens[e - 1], 0};
            for (int64_t i = r; i < e; ++i) group_of[i] = (int32_t)groups;
            ++groups;
        }
        r = e;
    }
    for (int64_t r = 0; cascade && r < n;) {
        if (group_of[r] >= 0) { ++r; continue; }
        const int32_t *t0 = block_tables + seq_idx[r] * bt_stride;
        int64_t shared = (row_lens[r] - 1) / bs;
        int64_t e = r + 1;
        while (e < n && group_of[e] < 0 && seq_idx[e] != seq_idx[e - 1]) {
            const int32_t *te = block_tables + seq_idx[e] * bt_stride;
            const int64_t own = (row_lens[e] - 1) / bs;
            const int64_t lim = shared < own ? shared : own;
            int64_t c = 0;
            while (c < lim && te[c] == t0[c]) ++c;
            if (c < CASCADE_MIN_BLOCKS) break;
            shared = c;
            ++e;
        }
        if (e - r < CASCADE_MIN_ROWS || shared < CASCADE_MIN_BLOCKS) {
            ++r;
            continue;
        }
        grp[groups] = (key_group){r, e - 1, 0, 0, (int32_t)(shared * bs), 1};
        for (int64_t i = r; i < e; ++i) group_of[i] = (int32_t)groups;
        ++groups;
        r = e;
    }
    for (int64_t k = 0; k < groups; ++k) grp[k].ld = ((int64_t)grp[k].keys + 15) / 16 * 16;
    return groups;
}

#endif

/* KV heads kvh .. kvh + nkv - 1 of one row; q and out point at the first of their heads. */
static void run_item(const float *q, const kv_layout *kv, const int32_t *table, int32_t len,
                     int kvh, int nkv, int group, int hd, float scale, float *out) {
#ifdef __AVX512F__
    if ((hd == 64 || hd == 128) && nkv * group <= MAX_HEADS) {
        item_avx512(q, kv, table, 0, len, kvh, nkv, group, hd, scale, 0, out);
        return;
    }
#endif
    for (int k = 0; k < nkv; ++k)
        item_generic(q + (int64_t)k * group * hd, kv, table, len, kvh + k, group, hd, scale,
                     out + (int64_t)k * group * hd);
}

/* Attention of n query rows: row r is query row tok_idx[r] of sequence seq_idx[r] (its block
 * table row) and sees the first row_lens[r] keys. Output goes to the same rows of out. */
int kp_paged_rows_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t num_blocks,
                      int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                      int32_t num_heads, const int32_t *block_tables, int64_t bt_stride,
                      const int32_t *row_lens, const int64_t *tok_idx, const int64_t *seq_idx,
                      int64_t n, float scale, float *out, int64_t out_row_stride) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads)
        return -1;
    kv_layout layout;
    layout.tok_stride = (int64_t)num_kv_heads * head_dim;
    layout.k_base = kv;
    layout.v_base = kv + num_blocks * (int64_t)block_size * layout.tok_stride;
    layout.block_size = block_size;
    /* A whole row per item reads each token's K (then V) for all heads as one contiguous run,
     * which the hardware prefetchers follow; with few rows per thread, split rows by KV head. */
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    const int per_item = (n >= 4 * threads) ? num_kv_heads : 1;
    const int splits = num_kv_heads / per_item;
    const int64_t items = n * splits;

    /* Rows that share keys with others go through the transposed keys (find_key_groups);
     * group_of[r] is row r's group, or -1. */
    int32_t *group_of = 0;
    key_group *grp = 0;
    float *kt = 0;
    int64_t groups = 0;
#ifdef __AVX512F__
    if ((head_dim == 64 || head_dim == 128) && n >= 2) {
        group_of = malloc((size_t)n * sizeof *group_of);
        grp = malloc((size_t)n * sizeof *grp);
        if (group_of && grp)
            groups = find_key_groups(row_lens, seq_idx, block_tables, bt_stride, block_size, n,
                                     per_item == num_kv_heads
                                         && (int64_t)num_kv_heads * group <= MAX_HEADS,
                                     group_of, grp);
        int64_t total = 0, slices = 0;
        for (int64_t k = 0; k < groups; ++k) {
            grp[k].off = total;
            total += grp[k].ld * layout.tok_stride;
            slices += grp[k].ld / 16;
        }
        /* Kept by the calling thread from call to call: a fresh buffer per layer would fault
         * its pages in every time. It grows to the largest step's need. */
        if (groups) kt = grow_buffer(&kt_keys, &kt_keys_cap, total);
        if (!kt) groups = 0;
        if (groups) {  /* fill the transposed keys: items are (group, 16-key slice) */
#pragma omp parallel for schedule(static)
            for (int64_t si = 0; si < slices; ++si) {
                int64_t k = 0, first = 0;
                while (si >= first + grp[k].ld / 16) first += grp[k++].ld / 16;
                kt_fill(&layout, block_tables + seq_idx[grp[k].first] * bt_stride, grp[k].keys,
                        num_kv_heads, head_dim, grp[k].ld, (int32_t)((si - first) * 16),
                        kt + grp[k].off);
            }
        }
    }
#else
    (void)kt;
    (void)groups;
#endif
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / splits;
        const int kvh = (int)(item % splits) * per_item;
        const int64_t tok = tok_idx[row];
        const float *qh = q + tok * q_row_stride + (int64_t)kvh * group * head_dim;
        float *oh = out + tok * out_row_stride + (int64_t)kvh * group * head_dim;
        const int32_t *table = block_tables + seq_idx[row] * bt_stride;
#ifdef __AVX512F__
        if (groups && group_of[row] >= 0) {
            /* Rows go in pairs from the group's first row: the first of a pair does both. */
            const key_group *g = &grp[group_of[row]];
            if ((row - g->first) % 2) continue;
            const int R = (row + 1 <= g->last) ? 2 : 1;
            const int64_t off = (int64_t)kvh * group * head_dim;
            const float *qr[2] = {qh, R > 1 ? q + tok_idx[row + 1] * q_row_stride + off : 0};
            float *orow[2] = {oh, R > 1 ? out + tok_idx[row + 1] * out_row_stride + off : 0};
            int rc;
            if (!g->cascade) {
                rc = kt_item(qr, kt + g->off, g->ld, &layout, table, row_lens + row, R, kvh,
                             per_item, group, head_dim, scale, orow, 0);
            } else {
                float state[2][2 * MAX_HEADS + MAX_HEADS * 128];  /* this path: head_dim <= 128 */
                float *st[2] = {state[0], state[1]};
                const int32_t lens[2] = {g->keys, g->keys};
                rc = kt_item(qr, kt + g->off, g->ld, &layout, table, lens, R, kvh, per_item,
                             group, head_dim, scale, orow, st);
                for (int i = 0; i < R && !rc; ++i) {
                    const int32_t *ti = block_tables + seq_idx[row + i] * bt_stride;
                    item_avx512(qr[i], &layout, ti, g->keys, row_lens[row + i], kvh, per_item,
                                group, head_dim, scale, st[i], orow[i]);
                }
            }
            if (rc) {
#pragma omp atomic write
                failed = 1;
            }
            continue;
        }
#endif
        run_item(qh, &layout, table, row_lens[row], kvh, per_item, group, head_dim, scale, oh);
    }
    free(group_of);
    free(grp);
    if (failed) return -2;
    return 0;
}
