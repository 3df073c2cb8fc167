/* Paged attention over a bfloat16 KV cache: kp_paged_rows_bf16 (kp_native.h).
 *
 * Why: a bf16 model on CPU gathered each decode row's blocks into a contiguous copy and ran
 * SDPA on it (about 40% of a bf16 step). This reads the bf16 keys and values once, straight
 * from the paged cache, as the fp32 row kernel (paged_rows.c) does: half the bytes.
 *
 * Queries, keys and values are bf16; scores, the online softmax and the weighted sums are fp32,
 * and each output is rounded to bf16 once, at the end (round to nearest even, as torch's
 * `.to(torch.bfloat16)`). Work item = (row, KV head): the query heads of the group share each
 * K/V row. Head dims 64, 128 and 256 (item_span) go over the keys in spans of SPAN: the
 * scores of the whole span for every query head, their online softmax, then the values with
 * each V row widened once, in registers, for up to V_HEADS heads whose accumulators stay in
 * registers too (independent FMA chains: one chain per accumulator vector through all keys
 * was the old loop's limit). Other head dims (item_bf16) go per chunk of CHUNK keys: the V
 * rows (and, without the dot instruction, the K rows) widened once into an fp32 scratch that
 * stays in L1; the next chunk's rows are prefetched meanwhile.
 *
 * Widening is exact (a bf16 is the top half of an fp32): zero-extend the 16 bits and shift
 * them up, one portable sequence for every level. Where the level has AVX512-BF16
 * (avx512_bf16, amx), q.k is `vdpbf16ps` straight from the bf16 rows: products of two bf16 are
 * exact in fp32, so only the order of the fp32 sum differs from the widened path. Any head_dim
 * up to MAX_HEAD_DIM: a multiple of the vector width takes the vector loops, others the
 * scalar ones. */
#include "kp_team.h"
#include "paged_span.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* hd bf16 values to fp32. */
static inline void widen(const uint16_t *src, float *dst, int hd) {
    int d = 0;
    for (; d + KP_VW <= hd; d += KP_VW) vstore(dst + d, vload_bf16(src + d));
    for (; d < hd; ++d) dst[d] = bf16_to_f32(src[d]);
}

static inline float dot_f32(const float *a, const float *b, int hd) {
    int d = 0;
    float s = 0.0f;
    if (hd >= KP_VW) {
        vf acc = vload(a) * vload(b);
        for (d = KP_VW; d + KP_VW <= hd; d += KP_VW) acc = vfma(vload(a + d), vload(b + d), acc);
        s = vhsum(acc);
    }
    for (; d < hd; ++d) s += a[d] * b[d];
    return s;
}

#if defined(__AVX512BF16__)
/* q.k over hd (a multiple of 32) bf16 values, in fp32, by the BF16 dot instruction. */
static inline float dot_bf16(const uint16_t *q, const uint16_t *k, int hd) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                               (__m512bh)_mm512_loadu_si512(k + d));
    return _mm512_reduce_add_ps(acc);
}
#endif

/* p[t] = scale * q.k_t for the n <= CHUNK widened keys in kbuf (rows of hd): KP_VW keys'
 * partial sums at a time, their horizontal sums taken together (vhsum_lanes). */
static inline void scores_f32(const float *q, const float *kbuf, int n, int hd, float scale,
                              float *p) {
    int t = 0;
    if (hd % KP_VW == 0) {
        for (; t + KP_VW <= n; t += KP_VW) {
            vf part[KP_VW];
            for (int u = 0; u < KP_VW; ++u) {
                const float *k = kbuf + (int64_t)(t + u) * hd;
                vf s = vload(q) * vload(k);
                for (int d = KP_VW; d < hd; d += KP_VW) s = vfma(vload(q + d), vload(k + d), s);
                part[u] = s;
            }
            vstore(p + t, vhsum_lanes(part) * scale);
        }
    }
    for (; t < n; ++t) p[t] = dot_f32(q, kbuf + (int64_t)t * hd, hd) * scale;
}

#if defined(__AVX512BF16__)
/* scores_f32 straight from the bf16 key rows by the BF16 dot instruction (hd a multiple of
 * 32, at most MAX_HEAD_DIM). */
static inline void scores_bf16(const uint16_t *q, const uint16_t *const *krow, int n, int hd,
                               float scale, float *p) {
    __m512bh qv[MAX_HEAD_DIM / 32];
    const int nq = hd / 32;
    for (int j = 0; j < nq; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        vf part[16];
        for (int u = 0; u < 16; ++u) {
            __m512 s = _mm512_setzero_ps();
            for (int j = 0; j < nq; ++j)
                s = _mm512_dpbf16_ps(s, qv[j], (__m512bh)_mm512_loadu_si512(krow[t + u] + 32 * j));
            part[u] = s;
        }
        vstore(p + t, vhsum_lanes(part) * scale);
    }
    for (; t < n; ++t) p[t] = dot_bf16(q, krow[t], hd) * scale;
}
#endif

/* The query heads of KV head kvh (q, out: the first of them) over keys start .. len - 1. */
static void item_bf16(const uint16_t *q, const kv16_layout *kv, const int32_t *table,
                      int32_t start, int32_t len, int kvh, int group, int hd, float scale,
                      float softcap, const float *sinks, uint16_t *out) {
    float qf[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];
    float kbuf[CHUNK * MAX_HEAD_DIM], vbuf[CHUNK * MAX_HEAD_DIM];
    float p[CHUNK], m[MAX_GROUP], l[MAX_GROUP];
    const uint16_t *krow[CHUNK], *vrow[CHUNK];
    const int32_t bs = kv->block_size;
#if defined(__AVX512BF16__)
    const int use_dp = hd % 32 == 0;
#else
    const int use_dp = 0;
#endif
    for (int g = 0; g < group; ++g) {
        widen(q + (int64_t)g * hd, qf + (int64_t)g * hd, hd);
        for (int d = 0; d < hd; ++d) acc[g * hd + d] = 0.0f;
        m[g] = 0.0f;
        l[g] = 0.0f;
    }
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (int32_t c0 = start; c0 < len; c0 += CHUNK) {
        const int n = (len - c0) < CHUNK ? (len - c0) : CHUNK;
        for (int t = 0; t < n; ++t) {
            const int32_t pos = c0 + t;
            const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * kv->tok_stride
                                + (int64_t)kvh * hd;
            krow[t] = kv->k_base + off;
            vrow[t] = kv->v_base + off;
        }
        /* Pull the next chunk's rows toward L2 while this one is computed (scattered blocks:
         * the hardware prefetchers cannot guess them). */
        for (int32_t pos = c0 + CHUNK; pos < len && pos < c0 + 2 * CHUNK; ++pos) {
            const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * kv->tok_stride
                                + (int64_t)kvh * hd;
            for (int b = 0; b < hd; b += 32) {
                __builtin_prefetch(kv->k_base + off + b, 0, 2);
                __builtin_prefetch(kv->v_base + off + b, 0, 2);
            }
        }
        if (!use_dp)
            for (int t = 0; t < n; ++t) widen(krow[t], kbuf + (int64_t)t * hd, hd);
        for (int t = 0; t < n; ++t) widen(vrow[t], vbuf + (int64_t)t * hd, hd);
        for (int g = 0; g < group; ++g) {
#if defined(__AVX512BF16__)
            if (use_dp)
                scores_bf16(q + (int64_t)g * hd, krow, n, hd, scale, p);
            else
#endif
                scores_f32(qf + (int64_t)g * hd, kbuf, n, hd, scale, p);
            if (softcap > 0.0f)
                for (int t = 0; t < n; ++t) p[t] = softcap * tanhf(p[t] * inv_cap);
            const float corr = pa_softmax_step(p, n, c0 == start, &m[g], &l[g]);
            pa_accumulate_v(acc + (int64_t)g * hd, corr, p, vbuf, n, hd);
        }
    }
    for (int g = 0; g < group; ++g) {
        const float sum = l[g] + pa_sink_term(sinks, g, m[g]);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int d = 0; d < hd; ++d) out[(int64_t)g * hd + d] = f32_to_bf16(acc[g * hd + d] * inv);
    }
}

/* item_bf16 for head dim HD (64, 128 or 256): in spans (paged_span.h). */
static inline __attribute__((always_inline)) void item_span(
    const uint16_t *q, const kv16_layout *kv16, const int32_t *table, int32_t start,
    int32_t len, int kvh, int group, const int HD, float scale, float softcap,
    const float *sinks, uint16_t *out) {
    float acc[MAX_GROUP * MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float qf[MAX_GROUP * MAX_HEAD_DIM];  /* q widened in vload_bf16_eo's order (no BF16 dot) */
    const span_cache kv = {kv16->k_base, kv16->v_base, 0, 0, kv16->tok_stride,
                           kv16->block_size, 0, 1.0f};
#if defined(__AVX512BF16__)
    vq_t qp[MAX_GROUP * 2 * (MAX_HEAD_DIM / 32)];  /* span_scores_dp's query vectors */
    for (int g = 0; g < group; ++g)
        for (int j = 0; j < HD / 32; ++j) {
            const __m512i v = _mm512_loadu_si512(q + (int64_t)g * HD + 32 * j);
            qp[(g * (HD / 32) + j) * 2] = v;
            qp[(g * (HD / 32) + j) * 2 + 1] = _mm512_shuffle_i64x2(v, v, 0x4E);
        }
#else
    const vq_t *qp = 0;
    for (int i = 0; i < group * HD; i += 2 * KP_VW) {
        vf e, o;
        vload_bf16_eo(q + i, &e, &o);
        vstore(qf + i, e);
        vstore(qf + i + KP_VW, o);
    }
#endif
    for (int i = 0; i < group * HD; ++i) acc[i] = 0.0f;
    for (int g = 0; g < group; ++g) m[g] = l[g] = 0.0f;
    span_item(qp, qf, &kv, table, start, len, kvh, group, HD, scale, softcap, acc, m, l,
              ROW_BF16);
    for (int g = 0; g < group; ++g) {
        const float sum = l[g] + pa_sink_term(sinks, g, m[g]);
        const vf inv = vset1(sum > 0.0f ? 1.0f / sum : 0.0f);
        for (int d = 0; d < HD; d += 2 * KP_VW)
            vstore_bf16_eo(out + (int64_t)g * HD + d, vload(acc + g * HD + d) * inv,
                           vload(acc + g * HD + d + KP_VW) * inv);
    }
}

static void item_span64(const uint16_t *q, const kv16_layout *kv, const int32_t *table,
                        int32_t start, int32_t len, int kvh, int group, float scale,
                        float softcap, const float *sinks, uint16_t *out) {
    item_span(q, kv, table, start, len, kvh, group, 64, scale, softcap, sinks, out);
}

static void item_span256(const uint16_t *q, const kv16_layout *kv, const int32_t *table,
                         int32_t start, int32_t len, int kvh, int group, float scale,
                         float softcap, const float *sinks, uint16_t *out) {
    item_span(q, kv, table, start, len, kvh, group, 256, scale, softcap, sinks, out);
}

static void item_span128(const uint16_t *q, const kv16_layout *kv, const int32_t *table,
                         int32_t start, int32_t len, int kvh, int group, float scale,
                         float softcap, const float *sinks, uint16_t *out) {
    item_span(q, kv, table, start, len, kvh, group, 128, scale, softcap, sinks, out);
}

int kp_team_attention_ok(int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                         int32_t num_heads, int32_t window, float softcap) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0) return 0;
    return num_heads / num_kv_heads <= MAX_GROUP && head_dim <= MAX_HEAD_DIM &&
           block_size <= MAX_BLOCK && window >= 0 && softcap >= 0.0f;
}

void kp_team_attention_plan(kp_team_attention *sh, int32_t block_size, int32_t head_dim,
                            int32_t num_kv_heads, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *row_lens, const int64_t *seq_idx,
                            int64_t n, int32_t window, float softcap) {
    sh->group_of = 0;
    sh->grp = 0;
    sh->kt = 0;
    sh->groups = sh->slices = 0;
    sh->failed = 0;
    sh->sinks = 0;
    /* Prefill runs go through the transposed keys (paged_bf16_tile.c); group_of[r] is row r's
     * run, or -1. Windowed and capped layers do not: the tiles have neither. */
    if (pa_vector_head(head_dim) && n >= 2 && window == 0 && softcap == 0.0f) {
        kv16_layout layout = {0};
        layout.block_size = block_size;
        sh->group_of = malloc((size_t)n * sizeof *sh->group_of);
        sh->grp = malloc((size_t)n * sizeof(key_group));
        if (sh->group_of && sh->grp)
            sh->groups = pa_kt16_plan(&layout, row_lens, seq_idx, block_tables, bt_stride, n,
                                      num_kv_heads, head_dim, sh->group_of, sh->grp, &sh->kt,
                                      &sh->slices);
    }
}

void kp_team_attention_free(kp_team_attention *sh) {
    free(sh->group_of);
    free(sh->grp);
}

void kp_team_paged_rows_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                             int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                             int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                             const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                             float softcap, uint16_t *out, int64_t out_row_stride,
                             kp_team_attention *sh) {
    const int group = num_heads / num_kv_heads;
    kv16_layout layout;
    layout.tok_stride = (int64_t)num_kv_heads * head_dim;
    layout.k_base = kv;
    layout.v_base = kv + num_blocks * (int64_t)block_size * layout.tok_stride;
    layout.block_size = block_size;
    const int32_t *group_of = sh->group_of;
    const key_group *grp = sh->grp;
    const uint32_t *kt = sh->kt;
    const int64_t groups = sh->groups, slices = sh->slices;
    if (slices) {  /* the prefill runs' keys, transposed: items (run, 16-key slice) */
#pragma omp for schedule(static)
        for (int64_t si = 0; si < slices; ++si)
            pa_kt16_fill(&layout, seq_idx, block_tables, bt_stride, grp, num_kv_heads, head_dim,
                         kt, si);
    }
    const int64_t items = n * num_kv_heads;
#pragma omp for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / num_kv_heads;
        const int kvh = (int)(item % num_kv_heads);
        const int64_t tok = tok_idx[row];
        const int64_t head0 = (int64_t)kvh * group * head_dim;
        const int32_t *table = block_tables + seq_idx[row] * bt_stride;
        if (groups && group_of[row] >= 0) {  /* rows in pairs: the first of a pair does both */
            const key_group *g = &grp[group_of[row]];
            if ((row - g->first) % 2) continue;
            const int R = row + 1 <= g->last ? 2 : 1;
            const uint16_t *qr[2] = {q + tok * q_row_stride + head0,
                                     R > 1 ? q + tok_idx[row + 1] * q_row_stride + head0 : 0};
            uint16_t *orow[2] = {out + tok * out_row_stride + head0,
                                 R > 1 ? out + tok_idx[row + 1] * out_row_stride + head0 : 0};
            if (pa_kt16_item(qr, kt + g->off, g->ld, &layout, table, row_lens + row, R, kvh,
                             group, head_dim, scale, orow)) {
#pragma omp atomic write
                sh->failed = 1;
            }
            continue;
        }
        const int32_t len = row_lens[row];
        const int32_t start = (window > 0 && len > window) ? len - window : 0;
        const uint16_t *qh = q + tok * q_row_stride + head0;
        uint16_t *oh = out + tok * out_row_stride + head0;
        const float *sk = sh->sinks ? sh->sinks + (int64_t)kvh * group : 0;
        if (head_dim == 64)
            item_span64(qh, &layout, table, start, len, kvh, group, scale, softcap, sk, oh);
        else if (head_dim == 128)
            item_span128(qh, &layout, table, start, len, kvh, group, scale, softcap, sk, oh);
        else if (head_dim == 256)
            item_span256(qh, &layout, table, start, len, kvh, group, scale, softcap, sk, oh);
        else
            item_bf16(qh, &layout, table, start, len, kvh, group, head_dim, scale, softcap, sk,
                      oh);
    }
}

int kp_paged_rows_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                       int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                       int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                       const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                       float softcap, uint16_t *out, int64_t out_row_stride) {
    return kp_paged_rows_sinks_bf16(q, q_row_stride, kv, num_blocks, block_size, num_kv_heads,
                                    head_dim, num_heads, block_tables, bt_stride, row_lens,
                                    tok_idx, seq_idx, n, scale, window, softcap, 0, out,
                                    out_row_stride);
}

/* With sinks (one logit per query head, or NULL): no prefill tiles (they have no sink term),
 * every row on the row kernel. */
int kp_paged_rows_sinks_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                             int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                             int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                             int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                             const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                             float softcap, const float *sinks, uint16_t *out,
                             int64_t out_row_stride) {
    if (!kp_team_attention_ok(block_size, num_kv_heads, head_dim, num_heads, window, softcap))
        return -1;
    kp_team_attention sh;
    kp_team_attention_plan(&sh, block_size, head_dim, num_kv_heads, block_tables, bt_stride,
                           row_lens, seq_idx, sinks ? 0 : n, window, softcap);
    sh.sinks = sinks;
#pragma omp parallel
    kp_team_paged_rows_bf16(q, q_row_stride, kv, num_blocks, block_size, num_kv_heads, head_dim,
                            num_heads, block_tables, bt_stride, row_lens, tok_idx, seq_idx, n,
                            scale, window, softcap, out, out_row_stride, &sh);
    kp_team_attention_free(&sh);
    return sh.failed ? -2 : 0;
}
