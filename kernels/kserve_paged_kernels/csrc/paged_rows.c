/* Paged attention, the row kernel: one query row at a time (paged_attention.h).
 *
 * Work item = (row, KV head) or, with many rows, the whole row: the query heads sharing a KV
 * head are processed together, so each K/V row is loaded once for the group. The context is
 * walked in chunks of CHUNK keys: scores for the chunk, one vectorised exp pass and one rescale
 * of the running sum and accumulator (online softmax), then the weighted V rows, while the next
 * chunk is prefetched. Consecutive rows of one prefill sequence re-read the same K/V, which
 * stays in cache. Head dims 64, 128 and 256 take the vector version (kp_vec.h, every level: q
 * and the accumulators in registers as far as the register file allows; q of 256 stays in
 * memory, scores_wide); soft-capped layers and other head dims the portable loop. CHUNK = 32 measured best for the prefetch distance, against 16, 64 and 128.
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

/* a . b over hd floats: whole vectors on four independent FMA chains (a single chain would
 * wait on each FMA's latency), the remainder scalar. */
static inline float dot_chains(const float *a, const float *b, int hd) {
    vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
    int d = 0;
    for (; d + 4 * KP_VW <= hd; d += 4 * KP_VW) {
        s0 = vfma(vload(a + d), vload(b + d), s0);
        s1 = vfma(vload(a + d + KP_VW), vload(b + d + KP_VW), s1);
        s2 = vfma(vload(a + d + 2 * KP_VW), vload(b + d + 2 * KP_VW), s2);
        s3 = vfma(vload(a + d + 3 * KP_VW), vload(b + d + 3 * KP_VW), s3);
    }
    for (; d + KP_VW <= hd; d += KP_VW) s0 = vfma(vload(a + d), vload(b + d), s0);
    float s = vhsum((s0 + s1) + (s2 + s3));
    for (; d < hd; ++d) s += a[d] * b[d];
    return s;
}

/* acc += w * v over hd floats (whole vectors, then the remainder). */
static inline void axpy_rows(float *acc, float w, const float *v, int hd) {
    const vf wv = vset1(w);
    int d = 0;
    for (; d + KP_VW <= hd; d += KP_VW) vstore(acc + d, vfma(wv, vload(v + d), vload(acc + d)));
    for (; d < hd; ++d) acc[d] += w * v[d];
}

/* Portable version (the head dims without a register pass, e.g. Gemma-3's 256, and soft-capped
 * layers): any head_dim up to MAX_HEAD_DIM, keys start .. len - 1 (a sliding window
 * starts past 0); softcap > 0 caps each scaled score s to softcap * tanh(s / softcap). */
void pa_item_generic(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                     int32_t len, int kvh, int group, int hd, float scale, float softcap,
                     const float *sinks, float *out) {
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
            for (int t = 0; t < n; ++t) pg[t] = dot_chains(qg, krow[t], hd);
            if (softcap > 0.0f)
                for (int t = 0; t < n; ++t) pg[t] = softcap * tanhf(pg[t] * inv_cap);
            const float corr = softmax_chunk(pg, n, &m[g], &l[g]);
            float *ag = acc + g * hd;
            for (int d = 0; d < hd; ++d) ag[d] *= corr;
            for (int t = 0; t < n; ++t) axpy_rows(ag, pg[t], vrow[t], hd);
        }
    }
    for (int g = 0; g < group; ++g) {
        const float sum = l[g] + pa_sink_term(sinks, g, m[g]);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
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

/* softmax_chunk for n <= CHUNK scores, all in registers: no scalar passes over the chunk. */
#define CHUNK_V (CHUNK / KP_VW)
static inline float softmax_chunk_vec(float *p, int n, float *m, float *l) {
    vf s[CHUNK_V];
    vf top = vset1(-3.0e38f);
    for (int c = 0; c < CHUNK_V; ++c) {
        const int left = n - c * KP_VW;
        s[c] = left >= KP_VW ? vload(p + c * KP_VW)
               : vselect(vlanes_below(left > 0 ? left : 0), vload_n(p + c * KP_VW, left > 0 ? left : 0),
                         vset1(-3.0e38f));
        top = vmax(top, s[c]);
    }
    const float cmax = vhmax(top);
    const float mx = cmax > *m ? cmax : *m;
    const float corr = (*m == -INFINITY) ? 0.0f : expf(*m - mx);
    vf sum = vzero();
    for (int c = 0; c < CHUNK_V; ++c) {
        const int left = n - c * KP_VW;
        if (left <= 0) break;
        const vf e = vexp(s[c] - mx);
        if (left >= KP_VW) {
            vstore(p + c * KP_VW, e);
            sum += e;
        } else {
            const vf kept = vselect(vlanes_below(left), e, vzero());
            vstore_n(p + c * KP_VW, kept, left);
            sum += kept;
        }
    }
    *l = *l * corr + vhsum(sum);
    *m = mx;
    return corr;
}

/* Vector version for head_dim = KP_VW * NV. Per chunk of keys and per KV head, the query heads
 * of the group are taken a few at a time (`gb`, a compile-time constant so q and the
 * accumulators stay in registers): each K row and each V row is loaded once for all of them.
 * Scores come KP_VW keys at a time, their horizontal sums taken together (vhsum_lanes). While
 * a chunk is processed, the next chunk's K and V rows are prefetched toward L2, spread evenly
 * over every pass of the chunk, so the memory system keeps fetching the scattered blocks while
 * the core computes. A burst of them in one pass (AVX2 takes one query head a pass, nine
 * passes a chunk for SmolLM2) filled the core's miss queue and stalled that pass; the even
 * spread measured faster (bench/probes/decode_attention_prefetch.py, BENCHMARKS.md). */
#define PASS_MAX 4

/* Keys per block of the wide score pass: as many as keep gb x KU sums, the gb q vectors and
 * a K vector in registers (AVX-512: 4 keys for 4 heads, 8 for fewer; AVX2: 2, 4 and 8). */
static inline __attribute__((always_inline)) int wide_keys(int gb) {
#define WK_FITS(u) (gb * (u) + gb + 1 <= KP_VREGS - 2)
    return WK_FITS(8) ? 8 : WK_FITS(4) ? 4 : WK_FITS(2) ? 2 : 1;
#undef WK_FITS
}

/* Scores of gb query heads over n keys for heads too long to keep q in registers (head_dim
 * 256): KU keys at a time, each q vector loaded once for the KU keys and each K vector once
 * for the gb heads, gb x KU independent FMA chains; the sums of KP_VW keys go into their
 * lanes together (vhsum_lanes). The last block computes whole groups of KU keys (rows past n
 * repeat the last key; their scores are masked by the softmax). */
static inline __attribute__((always_inline)) void scores_wide(
    const float *q, const int gb, const int NV, const float *const *krow, int n, int64_t koff,
    float scale, float *p) {
    const int hd = KP_VW * NV;
    const int KU = wide_keys(gb);
    for (int t = 0; t < n; t += KP_VW) {
        const int nb = (n - t) < KP_VW ? (n - t) : KP_VW;
        vf part[PASS_MAX][KP_VW];
        for (int u0 = 0; u0 < KP_VW; u0 += KU) {
            if (u0 >= nb) {
                for (int i = 0; i < gb; ++i)
                    for (int u = 0; u < KU; ++u) part[i][u0 + u] = vzero();
                continue;
            }
            const float *kr[8];
            for (int u = 0; u < KU; ++u)
                kr[u] = krow[t + (u0 + u < nb ? u0 + u : nb - 1)] + koff;
            vf acc[PASS_MAX][8];
            for (int i = 0; i < gb; ++i)
                for (int u = 0; u < KU; ++u) acc[i][u] = vzero();
            for (int j = 0; j < NV; ++j) {
                vf k[8];
                for (int u = 0; u < KU; ++u) k[u] = vload(kr[u] + KP_VW * j);
                for (int i = 0; i < gb; ++i) {
                    const vf qv = vload(q + i * hd + KP_VW * j);
                    for (int u = 0; u < KU; ++u) acc[i][u] = vfma(qv, k[u], acc[i][u]);
                }
            }
            for (int i = 0; i < gb; ++i)
                for (int u = 0; u < KU; ++u) part[i][u0 + u] = acc[i][u];
        }
        for (int i = 0; i < gb; ++i) {
            const vf s = vhsum_lanes(part[i]) * scale;
            if (nb == KP_VW)
                vstore(p + i * CHUNK + t, s);
            else
                vstore_n(p + i * CHUNK + t, s, nb);
        }
    }
}

/* The next chunk's lines a pass prefetches: `count` lines of the flat list (key u's K row,
 * then its V row, `lines` cache lines each) from line `row * lines + line`, spread evenly over
 * the pass's V loop (no divisions in the loop: an error term, as in line drawing). */
typedef struct {
    const float *const *k, *const *v;
    int64_t row;
    int line, lines, count;
} pf_share;

static inline __attribute__((always_inline)) void pf_next(pf_share *pf) {
    const float *base = (pf->row & 1) ? pf->v[pf->row >> 1] : pf->k[pf->row >> 1];
    __builtin_prefetch(base + 16 * pf->line, 0, 2);
    if (++pf->line == pf->lines) {
        pf->line = 0;
        ++pf->row;
    }
}

static inline __attribute__((always_inline)) void pass_vec(
    const float *q, const int gb, const int NV, const float *const *krow,
    const float *const *vrow, pf_share *pf, int n, int64_t koff, float scale, float *p,
    float *m, float *l, float *accbuf) {
    const int hd = KP_VW * NV;
    if (NV > MAX_NV) {
        scores_wide(q, gb, NV, krow, n, koff, scale, p);
    } else {
    vf qv[PASS_MAX][MAX_NV];
    for (int i = 0; i < gb; ++i)
        for (int j = 0; j < NV; ++j) qv[i][j] = vload(q + i * hd + KP_VW * j) * scale;
    int t = 0;
    for (; t + KP_VW <= n; t += KP_VW) {
        vf part[PASS_MAX][KP_VW];
        for (int u = 0; u < KP_VW; ++u) {
            const float *kt = krow[t + u] + koff;
            for (int i = 0; i < gb; ++i) {
                vf s = qv[i][0] * vload(kt);
                for (int j = 1; j < NV; ++j) s = vfma(qv[i][j], vload(kt + KP_VW * j), s);
                part[i][u] = s;
            }
        }
        for (int i = 0; i < gb; ++i) vstore(p + i * CHUNK + t, vhsum_lanes(part[i]));
    }
    for (; t < n; ++t) {
        const float *kt = krow[t] + koff;
        for (int i = 0; i < gb; ++i) {
            vf s = qv[i][0] * vload(kt);
            for (int j = 1; j < NV; ++j) s = vfma(qv[i][j], vload(kt + KP_VW * j), s);
            p[i * CHUNK + t] = vhsum(s);
        }
    }
    }
    float corr[PASS_MAX];
    for (int i = 0; i < gb; ++i) corr[i] = softmax_chunk_vec(p + i * CHUNK, n, &m[i], &l[i]);
    /* The weighted V rows, a slice of the head at a time where the register file is small. */
    const int DV = pa_v_slice(gb, NV < MAX_NV ? NV : MAX_NV);
    int err = 0;
    for (int j0 = 0; j0 < NV; j0 += DV) {
        vf a[PASS_MAX][MAX_NV];
        for (int i = 0; i < gb; ++i)
            for (int j = 0; j < DV; ++j)
                a[i][j] = vload(accbuf + i * hd + KP_VW * (j0 + j)) * corr[i];
        for (int u = 0; u < n; ++u) {
            if (j0 == 0 && pf->count) {
                err += pf->count;
                for (; err >= n; err -= n) pf_next(pf);
            }
            const float *vt = vrow[u] + koff + KP_VW * j0;
            vf v[MAX_NV];
            for (int j = 0; j < DV; ++j) v[j] = vload(vt + KP_VW * j);
            for (int i = 0; i < gb; ++i) {
                const vf w = vset1(p[i * CHUNK + u]);
                for (int j = 0; j < DV; ++j) a[i][j] = vfma(w, v[j], a[i][j]);
            }
        }
        for (int i = 0; i < gb; ++i)
            for (int j = 0; j < DV; ++j) vstore(accbuf + i * hd + KP_VW * (j0 + j), a[i][j]);
    }
}

/* One pass over a chunk for `gb` query heads of one KV head; gb is dispatched to a constant so
 * pass_vec is specialised per count. */
#define DEFINE_PASS(NAME, NV)                                                                   \
    static void NAME(const float *q, int gb, const float *const *krow,                         \
                     const float *const *vrow, pf_share *pf, int n, int64_t koff,               \
                     float scale, float *p, float *m, float *l, float *accbuf) {                \
        switch (gb) {                                                                           \
        case 1: pass_vec(q, 1, NV, krow, vrow, pf, n, koff, scale, p, m, l, accbuf); break; \
        case 2: pass_vec(q, 2, NV, krow, vrow, pf, n, koff, scale, p, m, l, accbuf); break; \
        case 3: pass_vec(q, 3, NV, krow, vrow, pf, n, koff, scale, p, m, l, accbuf); break; \
        default: pass_vec(q, 4, NV, krow, vrow, pf, n, koff, scale, p, m, l, accbuf); break; \
        }                                                                                       \
    }
DEFINE_PASS(pass_hd64, 64 / KP_VW)
DEFINE_PASS(pass_hd128, 128 / KP_VW)
DEFINE_PASS(pass_hd256, 256 / KP_VW)

/* Query heads per pass: as many as keep their q vectors in half the register file (AVX-512: 4
 * of head_dim 64, 2 of 128; AVX2: 1). */
static inline int heads_per_pass(int hd) {
    if (hd > KP_VW * MAX_NV) return PASS_MAX;  /* scores_wide: q stays in memory */
    const int per = (KP_VREGS / 2) / (hd / KP_VW);
    return per < 1 ? 1 : per > PASS_MAX ? PASS_MAX : per;
}

/* KV heads kvh .. kvh + nkv - 1 of one row (q and out at the first of their query heads). */
/* Keys start .. len - 1; with `state` (m, l per head, then the unnormalised accumulators
 * [heads][hd]) the online softmax goes on from there instead of from nothing: how a row's
 * own keys follow a shared prefix done elsewhere (cascade). */
void pa_item_vec(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                 int32_t len, int kvh, int nkv, int group, int hd, float scale,
                 const float *state, const float *sinks, float *out) {
    const int heads = nkv * group;
    const int per_pass = heads_per_pass(hd);
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
        /* Every pass prefetches an equal share of the next chunk's K and V rows (all heads of
         * the item, in memory order), spread over its V loop. */
        const int passes = nkv * ((group + per_pass - 1) / per_pass);
        pf_share pf = {nk, nv, 0, 0, (int)(((int64_t)nkv * hd + 15) / 16), 0};
        const int64_t total = (int64_t)2 * nnext * pf.lines;
        int pass = 0;
        for (int h = 0; h < nkv; ++h) {
            const int64_t koff = (int64_t)h * hd;
            for (int g = 0; g < group; g += per_pass, ++pass) {
                const int gb = (group - g) < per_pass ? (group - g) : per_pass;
                const int head = h * group + g;
                pf.count = (int)(total * (pass + 1) / passes - total * pass / passes);
                if (hd == 64)
                    pass_hd64(q + (int64_t)head * hd, gb, krow, vrow, &pf, n, koff, scale, p,
                              m + head, l + head, accbuf + (int64_t)head * hd);
                else if (hd == 128)
                    pass_hd128(q + (int64_t)head * hd, gb, krow, vrow, &pf, n, koff, scale, p,
                               m + head, l + head, accbuf + (int64_t)head * hd);
                else
                    pass_hd256(q + (int64_t)head * hd, gb, krow, vrow, &pf, n, koff, scale, p,
                               m + head, l + head, accbuf + (int64_t)head * hd);
            }
        }
        cur = 1 - cur;
    }
    for (int g = 0; g < heads; ++g) {
        const float sum = l[g] + pa_sink_term(sinks, g, m[g]);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int j = 0; j < hd; j += KP_VW)
            vstore(out + (int64_t)g * hd + j, vload(accbuf + (int64_t)g * hd + j) * inv);
    }
}
