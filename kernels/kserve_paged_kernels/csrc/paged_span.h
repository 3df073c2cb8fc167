/* Decode attention in spans: the row kernel that the bf16 and one-byte caches share
 * (paged_bf16.c, paged_q8.c) for head dims 64, 128 and 256.
 *
 * Why: the value step of a row kernel that walks keys in chunks of 32 and one query head at a
 * time reloads its accumulators every chunk and, where a head's accumulators fill the register
 * file (AVX2), reloads every K and V row once per query head. Here the keys go in spans of
 * SPAN: the scores of the whole span for every query head of the group (KP_VW keys at a time,
 * their horizontal sums taken together), their online softmax, then the values with each V row
 * loaded (and widened) once, in registers, for up to V_HEADS query heads whose accumulators
 * stay in registers too (a slice of the head at a time where they do not fit: pa_v_slice), so
 * their FMA chains run side by side. Row offsets come a block's run at a time (no division per
 * key); the score loop prefetches the K and V rows PF_AHEAD keys ahead.
 *
 * The fp32 cache keeps its chunked row kernel (paged_rows.c): in spans it was faster in L3 but
 * slower from memory, where that kernel prefetches a whole row's KV heads at once.
 *
 * One source for both caches: KIND (a compile-time constant) says how a row's elements become
 * fp32 vectors: ROW_BF16 widens bf16 pairs (vload_bf16_eo: the
 * accumulators, and q where it is widened, are in that pair order); KP_KV_INT8 / E4M3 / E5M2
 * widen codes (kp_kvq.h), whose per-(block, head) scales multiply each key's score and each
 * value's softmax weight (kmul, vmul: the per-element work is the widening alone). With
 * AVX512-BF16, a bf16 cache's q.k is `vdpbf16ps` straight from the rows instead.
 */
#ifndef KP_PAGED_SPAN_H
#define KP_PAGED_SPAN_H

#include "kp_bf16.h"
#include "kp_kvq.h"
#include "paged_attention.h"

#define SPAN 256      /* keys per span: scores of a span for every head of the group, then V */
#define PF_AHEAD 32   /* keys ahead whose K and V rows the score loop prefetches */
#define V_HEADS 4     /* query heads at most per pass over a span's values */
#define SPAN_NV (MAX_HEAD_DIM / KP_VW) /* vectors of the longest head */
#define ROW_BF16 4    /* the one-byte kinds are their KP_KV_* formats, 1 .. 3 */

/* Bytes per element of a row of KIND. */
#define ROW_BYTES(KIND) ((KIND) == ROW_BF16 ? 2 : 1)

/* The cache as the span kernel reads it: element offsets from k_base / v_base. With one-byte
 * codes, k_scale / v_scale ([num_blocks, heads]) times unit are each (block, head)'s scale. */
typedef struct {
    const void *k_base, *v_base;
    const float *k_scale, *v_scale;
    int64_t tok_stride;
    int32_t block_size, heads;
    float unit;
} span_cache;

/* Offsets (elements) of the rows of keys c0 .. c0 + n - 1 of KV head kvh, block by block;
 * blk (or NULL): each key's block. */
static inline void span_offsets(const span_cache *kv, const int32_t *table, int32_t c0, int n,
                                int kvh, int hd, int64_t *off, int32_t *blk) {
    const int32_t bs = kv->block_size;
    int32_t b = c0 / bs, u = c0 % bs;
    for (int t = 0; t < n; ++b, u = 0) {
        const int64_t base = (int64_t)table[b] * bs * kv->tok_stride + (int64_t)kvh * hd;
        const int cnt = bs - u < n - t ? bs - u : n - t;
        for (int i = 0; i < cnt; ++i) off[t + i] = base + (int64_t)(u + i) * kv->tok_stride;
        if (blk)
            for (int i = 0; i < cnt; ++i) blk[t + i] = table[b];
        t += cnt;
    }
}

/* The K and V rows (hd elements each) at offset o toward the caches. */
static inline __attribute__((always_inline)) void span_prefetch(const span_cache *kv,
                                                                int64_t o, int hd,
                                                                const int KIND) {
    const char *k = (const char *)kv->k_base + o * ROW_BYTES(KIND);
    const char *v = (const char *)kv->v_base + o * ROW_BYTES(KIND);
    for (int b = 0; b < hd * ROW_BYTES(KIND); b += 64) {
        __builtin_prefetch(k + b, 0, 3);
        __builtin_prefetch(v + b, 0, 3);
    }
}

/* Elements j .. j + 2 * KP_VW - 1 of the row at offset o from base as two fp32 vectors (bf16:
 * in their pairs' order). */
static inline __attribute__((always_inline)) void span_load2(const void *base, int64_t o, int j,
                                                             const int KIND, vf *a, vf *b) {
    if (KIND == ROW_BF16) {
        vload_bf16_eo((const uint16_t *)base + o + j, a, b);
    } else {
        const uint8_t *r = (const uint8_t *)base + o + j;
        *a = kvq_widen(r, KIND);
        *b = kvq_widen(r + KP_VW, KIND);
    }
}

#if defined(__AVX512BF16__)
typedef __m512i vq_t; /* a query's 32 bf16 dims, and the same with its 256-bit halves swapped */

/* The 8 pair sums of span_scores_dp to the 16 keys' dot products, key i in lane i: block b of
 * the result gathers the halves of block b's keys (vhsum_lanes' tree, three levels). */
static inline vf hsum_key_pairs(const vf v[8]) {
    __m512 x[4], y[2];
    for (int i = 0; i < 4; ++i)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* 16 bf16 keys k[0 .. 16) against every query head (qp: span_item's query vectors), into
 * s[g * SPAN] .. + 15, times scale. Keys in pairs (c, 4 + c) and (8 + c, 12 + c), c < 4: x
 * holds the first key's low and the second key's high half of each 32 dims, y the rest,
 * crosswise; against q and q with its halves swapped, lanes 0-7 of a pair's sum are the first
 * key's partial dot products and lanes 8-15 the second's. Built once for every head. */
static inline __attribute__((always_inline)) void span_scores_dp(
    const vq_t *qp, int group, const int HD, const uint16_t *const *k, float scale, float *s) {
    __m512i x[8][MAX_HEAD_DIM / 32], y[8][MAX_HEAD_DIM / 32];
    for (int p = 0; p < 8; ++p) {
        const uint16_t *ka = k[(p / 4) * 8 + p % 4], *kb = k[(p / 4) * 8 + p % 4 + 4];
        for (int j = 0; j < HD / 32; ++j) {
            const __m512i a = _mm512_loadu_si512(ka + 32 * j);
            const __m512i b = _mm512_loadu_si512(kb + 32 * j);
            x[p][j] = _mm512_mask_blend_epi32(0xFF00, a, b);
            y[p][j] = _mm512_shuffle_i64x2(a, b, 0x4E);
        }
    }
    for (int g = 0; g < group; ++g) {
        const __m512i *qg = qp + (int64_t)g * 2 * (HD / 32);
        vf part[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
            __m512 a = _mm512_setzero_ps();
            for (int j = 0; j < HD / 32; ++j) {
                a = _mm512_dpbf16_ps(a, (__m512bh)qg[2 * j], (__m512bh)x[p][j]);
                a = _mm512_dpbf16_ps(a, (__m512bh)qg[2 * j + 1], (__m512bh)y[p][j]);
            }
            part[p] = a;
        }
        vstore(s + (int64_t)g * SPAN, hsum_key_pairs(part) * scale);
    }
}
#define SPAN_DP(KIND) ((KIND) == ROW_BF16)
#else
typedef int vq_t; /* unused without the BF16 dot */
#define SPAN_DP(KIND) 0
#endif

/* s[g * SPAN + t] = q_g.k_t times kmul[t] (or scale, kmul NULL) for the n keys at off[0 .. n)
 * and the `group` query heads from qf (fp32 rows of HD, in span_load2's order; qp instead
 * with the BF16 dot), KP_VW keys at a time, their horizontal sums taken together (vhsum_lanes;
 * a short last group repeats its first key, lanes past n are never read). The K and V rows of
 * keys up to n_ahead are prefetched PF_AHEAD keys ahead. */
static inline __attribute__((always_inline)) void span_scores(
    const vq_t *qp, const float *qf, int group, const int HD, const span_cache *kv,
    const int64_t *off, int n, int n_ahead, const float *kmul, float scale, float *s,
    const int KIND) {
    float kbuf[KP_VW * MAX_HEAD_DIM];  /* widened keys (not for the BF16 dot) */
    (void)qp;
    for (int t = 0; t < n; t += KP_VW) {
        const int m = n - t < KP_VW ? n - t : KP_VW;
        const int pf_end = t + PF_AHEAD + KP_VW < n_ahead ? t + PF_AHEAD + KP_VW : n_ahead;
        for (int u = t + PF_AHEAD; u < pf_end; ++u) span_prefetch(kv, off[u], HD, KIND);
        int64_t ko[KP_VW];
        for (int u = 0; u < KP_VW; ++u) ko[u] = off[t + (u < m ? u : 0)];
#if defined(__AVX512BF16__)
        if (SPAN_DP(KIND)) {
            const uint16_t *k[KP_VW];
            for (int u = 0; u < KP_VW; ++u) k[u] = (const uint16_t *)kv->k_base + ko[u];
            span_scores_dp(qp, group, HD, k, scale, s + t);
            continue;
        }
#endif
        const float *k[KP_VW];
        for (int u = 0; u < KP_VW; ++u) {
            k[u] = kbuf + u * HD;
            for (int j = 0; j < HD; j += 2 * KP_VW) {
                vf a, b;
                span_load2(kv->k_base, ko[u], j, KIND, &a, &b);
                vstore(kbuf + u * HD + j, a);
                vstore(kbuf + u * HD + j + KP_VW, b);
            }
        }
        const vf mul = kmul ? vload(kmul + t) : vset1(scale);
        for (int g = 0; g < group; ++g) {
            const float *qg = qf + (int64_t)g * HD;
            /* Each q vector loaded once for the KP_VW keys: KP_VW chains side by side. */
            vf part[KP_VW];
            const vf q0 = vload(qg);
#pragma GCC unroll 16
            for (int u = 0; u < KP_VW; ++u) part[u] = q0 * vload(k[u]);
            for (int j = KP_VW; j < HD; j += KP_VW) {
                const vf qj = vload(qg + j);
#pragma GCC unroll 16
                for (int u = 0; u < KP_VW; ++u) part[u] = vfma(qj, vload(k[u] + j), part[u]);
            }
            vstore(s + (int64_t)g * SPAN + t, vhsum_lanes(part) * mul);
        }
    }
}

/* Online softmax over a span: p[0 .. n) (n <= SPAN) replaced by exp(p - new max), the running
 * max *m and sum *l updated (`first`: no keys before); returns the factor for the old sum and
 * accumulator. */
static inline float span_softmax(float *p, int n, int first, float *m, float *l) {
    const int full = n / KP_VW * KP_VW;
    vf vmx = vset1(-3.0e38f);
    for (int t = 0; t < full; t += KP_VW) vmx = vmax(vmx, vload(p + t));
    if (full < n) vmx = vmax(vmx, vselect(vlanes_below(n - full), vload(p + full), vmx));
    float mx = vhmax(vmx);
    if (!first && *m > mx) mx = *m;
    const float corr = first ? 0.0f : expf(*m - mx);
    vf sum = vzero();
    for (int t = 0; t < full; t += KP_VW) {
        const vf e = vexp(vload(p + t) - mx);
        vstore(p + t, e);
        sum += e;
    }
    if (full < n) {
        const vf e = vselect(vlanes_below(n - full), vexp(vload(p + full) - mx), vzero());
        vstore(p + full, e);
        sum += e;
    }
    *l = *l * corr + vhsum(sum);
    *m = mx;
    return corr;
}

/* HB query heads' accumulators (acc: rows of NV vectors in span_load2's order) rescaled by
 * corr[h] plus the n value rows at off weighted by p (row h at p + h * SPAN): each V row loaded
 * once for all HB heads, the accumulators in registers (a slice of the head at a time where
 * they do not fit: pa_v_slice, at least 2 vectors at every level). */
static inline __attribute__((always_inline)) void span_values(
    float *acc, const float *corr, const float *p, const void *vb, const int64_t *off, int n,
    const int HB, const int NV, const int KIND) {
    /* pa_v_slice goes down to an eighth of the head; 2 vectors always fit */
    const int DV = pa_v_slice(HB, NV) < 2 ? 2 : pa_v_slice(HB, NV);
    for (int j0 = 0; j0 < NV; j0 += DV) {
        vf a[V_HEADS][SPAN_NV];
        for (int h = 0; h < HB; ++h)
            for (int j = 0; j < DV; ++j)
                a[h][j] = vload(acc + (h * NV + j0 + j) * KP_VW) * corr[h];
        for (int t = 0; t < n; ++t) {
            vf v[SPAN_NV];
            for (int j = 0; j < DV; j += 2)
                span_load2(vb, off[t], KP_VW * (j0 + j), KIND, &v[j], &v[j + 1]);
            for (int h = 0; h < HB; ++h) {
                const vf w = vset1(p[h * SPAN + t]);
                for (int j = 0; j < DV; ++j) a[h][j] = vfma(w, v[j], a[h][j]);
            }
        }
        for (int h = 0; h < HB; ++h)
            for (int j = 0; j < DV; ++j) vstore(acc + (h * NV + j0 + j) * KP_VW, a[h][j]);
    }
}

/* The `group` query heads of KV head kvh over keys start .. len - 1, head dim HD: q in qf
 * (fp32 rows in span_load2's order; qp instead with the BF16 dot), the unnormalised
 * accumulators in acc (same order), the running max and sum in m and l, all starting from
 * nothing. */
static inline __attribute__((always_inline)) void span_item(
    const vq_t *qp, const float *qf, const span_cache *kv, const int32_t *table, int32_t start,
    int32_t len, int kvh, int group, const int HD, float scale, float softcap, float *acc,
    float *m, float *l, const int KIND) {
    float s[MAX_GROUP * SPAN], corr[MAX_GROUP], kmul[SPAN], vmul[SPAN];
    int64_t off[SPAN + PF_AHEAD + KP_VW];
    int32_t blk[SPAN + PF_AHEAD + KP_VW];
    const int coded = KIND != ROW_BF16;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (int32_t c0 = start; c0 < len; c0 += SPAN) {
        const int n = (len - c0) < SPAN ? (len - c0) : SPAN;
        const int ahead = (len - c0) < SPAN + PF_AHEAD + KP_VW ? (len - c0)
                                                               : SPAN + PF_AHEAD + KP_VW;
        span_offsets(kv, table, c0, ahead, kvh, HD, off, coded ? blk : 0);
        if (c0 == start)
            for (int u = 0; u < PF_AHEAD && u < ahead; ++u) span_prefetch(kv, off[u], HD, KIND);
        if (coded) {
            const int padded = (n + KP_VW - 1) / KP_VW * KP_VW;
            for (int t = 0; t < n; ++t) {
                const int64_t sc = (int64_t)blk[t] * kv->heads + kvh;
                kmul[t] = kv->k_scale[sc] * kv->unit * scale;
                vmul[t] = kv->v_scale[sc] * kv->unit;
            }
            for (int t = n; t < padded; ++t) kmul[t] = 0.0f;
        }
        span_scores(qp, qf, group, HD, kv, off, n, ahead, coded ? kmul : 0, scale, s, KIND);
        const int first = c0 == start;
        for (int g = 0; g < group; ++g) {
            float *p = s + (int64_t)g * SPAN;
            if (softcap > 0.0f)
                for (int t = 0; t < n; ++t) p[t] = softcap * tanhf(p[t] * inv_cap);
            corr[g] = span_softmax(p, n, first, &m[g], &l[g]);
            if (coded)  /* the value's scale, after the sum */
                for (int t = 0; t < n; ++t) p[t] *= vmul[t];
        }
        for (int g0 = 0; g0 < group; g0 += V_HEADS) {
            float *a = acc + (int64_t)g0 * HD;
            const float *p = s + (int64_t)g0 * SPAN;
#define SV(HB) span_values(a, corr + g0, p, kv->v_base, off, n, HB, HD / KP_VW, KIND)
            switch (group - g0) {
                case 1: SV(1); break;
                case 2: SV(2); break;
                case 3: SV(3); break;
                default: SV(4); break;
            }
#undef SV
        }
    }
}

#endif
