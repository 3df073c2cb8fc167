/* Paged attention, the row kernel: one query row at a time (paged_attention.h).
 *
 * Work item = (row, KV head) or, with many rows, the whole row: the query heads sharing a KV
 * head are processed together, so each K/V row is loaded once for the group. Head dims 64 and
 * 128 take the spans of paged_span.h (every level: scores of 256 keys for every query head,
 * then each V row loaded once for up to 4 query heads whose accumulators stay in registers).
 * Every other case takes the portable loop, in chunks of CHUNK keys: scores for the chunk, the
 * online softmax's rescale, then the weighted V rows. Consecutive rows of one prefill sequence
 * re-read the same K/V, which stays in cache.
 */
#include "paged_span.h"

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

/* pa_item_vec for one head dim (a function each, so span_item is specialised): each KV head
 * in spans (paged_span.h), one after the other (spans outer and KV heads inner, prefetching a
 * whole row's heads, measured slower). */
static inline __attribute__((always_inline)) void item_span(
    const float *q, const kv_layout *kvl, const int32_t *table, int32_t start, int32_t len,
    int kvh, int nkv, int group, const int HD, float scale, const float *state, float *out) {
    const int heads = nkv * group;
    float acc[MAX_HEADS * MAX_HEAD_DIM], m[MAX_HEADS], l[MAX_HEADS];
    const span_cache kv = {kvl->k_base, kvl->v_base, 0, 0, kvl->tok_stride, kvl->block_size, 0,
                           1.0f};
    for (int g = 0; g < heads; ++g) {
        m[g] = state ? state[g] : 0.0f;
        l[g] = state ? state[heads + g] : 0.0f;
    }
    for (int64_t i = 0; i < (int64_t)heads * HD; ++i) acc[i] = state ? state[2 * heads + i] : 0.0f;
    for (int h = 0; h < nkv; ++h) {
        const int64_t g0 = (int64_t)h * group;
        span_item(0, q + g0 * HD, &kv, table, start, len, kvh + h, group, HD, scale, 0.0f,
                  !state, acc + g0 * HD, m + g0, l + g0, ROW_F32);
    }
    for (int g = 0; g < heads; ++g) {
        const vf inv = vset1(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int j = 0; j < HD; j += KP_VW)
            vstore(out + (int64_t)g * HD + j, vload(acc + (int64_t)g * HD + j) * inv);
    }
}

static void item_span64(const float *q, const kv_layout *kv, const int32_t *table,
                        int32_t start, int32_t len, int kvh, int nkv, int group, float scale,
                        const float *state, float *out) {
    item_span(q, kv, table, start, len, kvh, nkv, group, 64, scale, state, out);
}

static void item_span128(const float *q, const kv_layout *kv, const int32_t *table,
                         int32_t start, int32_t len, int kvh, int nkv, int group, float scale,
                         const float *state, float *out) {
    item_span(q, kv, table, start, len, kvh, nkv, group, 128, scale, state, out);
}

/* KV heads kvh .. kvh + nkv - 1 of one row (q and out at the first of their query heads),
 * head dim 64 or 128. Keys start .. len - 1; with `state` (m, l per head, then the
 * unnormalised accumulators [heads][hd]) the online softmax goes on from there instead of from
 * nothing: how a row's own keys follow a shared prefix done elsewhere (cascade). */
void pa_item_vec(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                 int32_t len, int kvh, int nkv, int group, int hd, float scale,
                 const float *state, float *out) {
    if (hd == 64)
        item_span64(q, kv, table, start, len, kvh, nkv, group, scale, state, out);
    else
        item_span128(q, kv, table, start, len, kvh, nkv, group, scale, state, out);
}
