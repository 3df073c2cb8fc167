/* Paged attention for rows that share keys: keys in the vector lanes (paged_attention.h).
 * The rows of one prefill chunk all read the same keys, and so do decode rows whose sequences
 * share a prompt prefix. For such a group (paged_prefix.c) the shared keys of each KV head are
 * first laid out transposed, once per call, as [head][group of KT_KEYS keys][head_dim][KT_KEYS];
 * a row's scores then come out KT_KEYS keys at a time (head_dim multiply-adds per vector of
 * scores, no horizontal sums), the softmax is taken over the whole score row (a few KiB), and
 * the V rows are read block by block. Two rows go together, so each K and V load feeds several
 * (row, head) pairs with the accumulators in registers. This is markedly faster than the row
 * kernel for prefill chunks (bench/probes/prefill_attention.py). For a shared prefix (cascade)
 * the tile hands its softmax max and sum on, unnormalised, and the row kernel goes on over the
 * row's own keys from there (pa_item_vec with a state). Written once over kp_vec.h: a group
 * of keys is one vector with AVX-512, two with AVX2, and the V loop holds a slice of the head
 * where the register file is small (pa_v_slice). */
#include "paged_attention.h"

float *pa_grow_buffer(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        const size_t bytes = ((size_t)n * sizeof(float) + 63) & ~(size_t)63;
        *buf = aligned_alloc(64, bytes);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* Keys t0 .. t0 + KT_KEYS - 1 (t0 a multiple of KT_KEYS) of all KV heads into their places in
 * kt (zero past len). */
void pa_kt_fill(const kv_layout *kv, const int32_t *table, int32_t len, int nkv, int hd,
                int64_t ld, int32_t t0, float *kt) {
    const int32_t bs = kv->block_size;
    for (int h = 0; h < nkv; ++h) {
        float *dst = kt + (int64_t)h * hd * ld + (int64_t)t0 * hd;  /* [hd][KT_KEYS] */
        for (int32_t t = t0; t < t0 + KT_KEYS; ++t) {
            float *col = dst + (t - t0);
            if (t < len) {
                const float *src = kv->k_base + ((int64_t)table[t / bs] * bs + t % bs) * kv->tok_stride
                                   + (int64_t)h * hd;
                for (int d = 0; d < hd; ++d) col[d * KT_KEYS] = src[d];
            } else {
                for (int d = 0; d < hd; ++d) col[d * KT_KEYS] = 0.0f;
            }
        }
    }
}

/* Query heads g0 .. g0 + gb - 1 of KV head h for R rows (R = 2: two consecutive rows of the
 * run, sharing every K and V load) over their first lens[r] keys. M = R * gb score rows, each
 * with its own softmax; the V loop keeps DV vectors of each of the M accumulators in registers
 * and walks the head in slices of DV. */
static inline __attribute__((always_inline)) void kt_tile(
    const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
    const int32_t *table, const int32_t *lens, int h, const int R, const int gb, const int NV,
    float scale, float *s, float *const *out, float *const *stats, int stats_heads) {
    const int hd = KP_VW * NV;
    const int M = R * gb;
    const int32_t bs = kv->block_size;
    const int32_t len = lens[R - 1] > lens[0] ? lens[R - 1] : lens[0];  /* the longer row */
    float qs[MAX_M * 128] __attribute__((aligned(64)));
    for (int m = 0; m < M; ++m)
        for (int d = 0; d < hd; ++d) qs[m * hd + d] = q[m / gb][(int64_t)(m % gb) * hd + d] * scale;
    const float *kh = kt + (int64_t)h * hd * ld;
    const int32_t groups = (len + KT_KEYS - 1) / KT_KEYS;
    for (int32_t j = 0; j < groups; ++j) {
        vf acc[MAX_M][KV_VECS];
        for (int m = 0; m < M; ++m)
            for (int c = 0; c < KV_VECS; ++c) acc[m][c] = vzero();
        const float *col = kh + (int64_t)j * KT_KEYS * hd;
        for (int d = 0; d < hd; ++d) {
            vf k[KV_VECS];
            for (int c = 0; c < KV_VECS; ++c) k[c] = vload(col + (int64_t)d * KT_KEYS + c * KP_VW);
            for (int m = 0; m < M; ++m) {
                const vf a = vset1(qs[m * hd + d]);
                for (int c = 0; c < KV_VECS; ++c) acc[m][c] = vfma(a, k[c], acc[m][c]);
            }
        }
        for (int m = 0; m < M; ++m)
            for (int c = 0; c < KV_VECS; ++c)
                vstore(s + m * ld + (int64_t)j * KT_KEYS + c * KP_VW, acc[m][c]);
    }
    float inv[MAX_M];
    for (int m = 0; m < M; ++m) {
        float mx;
        const float sum = pa_softmax_row(s + m * ld, lens[m / gb], groups * KT_KEYS, &mx);
        if (stats) {  /* cascade: hand on the max and the sum, the output stays unnormalised */
            float *st = stats[m / gb];
            st[m % gb] = mx;
            st[stats_heads + m % gb] = sum;
            inv[m] = 1.0f;
        } else {
            inv[m] = 1.0f / sum;
        }
    }
    const int DV = pa_v_slice(M, NV);
    for (int j0 = 0; j0 < NV; j0 += DV) {
        vf a[MAX_M][MAX_NV];
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < DV; ++j) a[m][j] = vzero();
        for (int32_t t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
            const float *base = kv->v_base + (int64_t)table[b] * bs * kv->tok_stride
                                + (int64_t)h * hd + KP_VW * j0;
            const int32_t nu = (len - t0) < bs ? (len - t0) : bs;
            for (int32_t u = 0; u < nu; ++u) {
                const float *vt = base + (int64_t)u * kv->tok_stride;
                vf v[MAX_NV];
                for (int j = 0; j < DV; ++j) v[j] = vload(vt + KP_VW * j);
                for (int m = 0; m < M; ++m) {
                    const vf w = vset1(s[m * ld + t0 + u]);
                    for (int j = 0; j < DV; ++j) a[m][j] = vfma(w, v[j], a[m][j]);
                }
            }
        }
        for (int m = 0; m < M; ++m) {
            float *o = out[m / gb] + (int64_t)(m % gb) * hd + KP_VW * j0;
            for (int j = 0; j < DV; ++j) vstore(o + KP_VW * j, a[m][j] * inv[m]);
        }
    }
}

/* kt_tile with R, gb and the head dim as constants. */
static void kt_dispatch(const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
                        const int32_t *table, const int32_t *lens, int h, int R, int gb, int hd,
                        float scale, float *s, float *const *out, float *const *stats,
                        int stats_heads) {
#define KT(RR, GB, NV) kt_tile(q, kt, ld, kv, table, lens, h, RR, GB, NV, scale, s, out, stats, \
                               stats_heads)
#define KT_ROWS(NV)                                                                      \
    if (R == 1) {                                                                        \
        switch (gb) { case 1: KT(1, 1, NV); break; case 2: KT(1, 2, NV); break;          \
                      case 3: KT(1, 3, NV); break; default: KT(1, 4, NV); break; }       \
    } else {                                                                             \
        switch (gb) { case 1: KT(2, 1, NV); break; case 2: KT(2, 2, NV); break;          \
                      default: KT(2, 3, NV); break; }                                    \
    }
    if (hd == 64) {
        KT_ROWS(64 / KP_VW)
    } else {
        KT_ROWS(128 / KP_VW)
    }
#undef KT_ROWS
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
    const int per_pass = pa_kt_heads(R, hd);
    float *s = pa_grow_buffer(&kt_scores, &kt_scores_cap, (int64_t)MAX_M * ld);
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

float *pa_transposed_keys(int64_t n) { return pa_grow_buffer(&kt_keys, &kt_keys_cap, n); }
