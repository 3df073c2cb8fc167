/* Paged attention on CPU, fp32, read straight from the paged KV cache: what the paged_*.c files
 * share. The PyTorch path has to gather each sequence's blocks into a contiguous copy before
 * attention (write the copy, read it again); this reads every K/V row once per query row.
 *
 * A query row is a new token: a decode token, or one token of a prefill chunk. Each row has its
 * own context length (a prefill token at position p sees p + 1 keys), which is how causality is
 * expressed, so prefill and decode rows go through the same code. A sliding window of W keys
 * makes a row of length len start at key len - W (the blocks before it are never touched),
 * and a soft cap c replaces each scaled score s by c * tanh(s / c) before the online softmax.
 *
 * The files, by job:
 * - paged_rows.c: the row kernel, one query row (all query heads of a KV head group) at a time
 *   over its keys in chunks, online softmax;
 * - paged_key_tile.c: rows that share keys (a prefill run, a shared prefix) over keys laid out
 *   transposed, 16 keys to a group (one vector with AVX-512, two with AVX2);
 * - paged_prefix.c: finding those groups of rows, prefill runs and cascade (shared-prefix)
 *   groups;
 * - paged_dispatch.c: kp_paged_rows_f32, which spreads rows over threads and picks the path;
 * - paged_bf16.c, paged_bf16_tile.c: the same over a bf16 cache (row kernel and prefill tiles);
 * - paged_span.h: the decode row kernel for head dims 64, 128 and 256 in spans of keys, one
 *   source for the bf16 and one-byte (paged_q8.c) caches.
 *
 * Layout (docs/kernels.md): kv = [2, num_blocks, block_size, num_kv_heads, head_dim].
 * Functions shared between the files carry the pa_ prefix; none is exported. The vector paths
 * are written once over kp_vec.h for every level; head dims 64 and 128 take them all, 256 the
 * row kernel (pa_row_head), any other the portable loop.
 */
#ifndef KP_PAGED_ATTENTION_H
#define KP_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kp_native.h"
#include "kp_vec.h"

#define MAX_GROUP 32
#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define CHUNK 32
#define KT_KEYS 16 /* keys per group of the transposed layout */
#define MAX_NV (128 / KP_VW) /* vectors of the longest head the vector paths take */
#define KV_VECS (KT_KEYS / KP_VW) /* vectors per group of transposed keys */
#define MAX_M 6 /* score rows of one key tile: R rows x gb heads */

/* The head dims the transposed-key tiles take. */
static inline int pa_vector_head(int hd) { return hd == 64 || hd == 128; }

/* The head dims the vector row kernel (pa_item_vec) takes: those, and 256 (Gemma-3), whose
 * scores keep q in memory (scores_wide in paged_rows.c). */
static inline int pa_row_head(int hd) { return pa_vector_head(hd) || hd == 256; }

/* Vectors of an accumulator row that a V loop over m rows holds at once: the largest power of
 * two, at most nv, with which the m rows' accumulators (and, for m > 1, the V vectors they
 * share) stay in registers. AVX-512 holds whole heads of 64 or 128 for the blockings used;
 * AVX2 goes over a head in slices. */
static inline __attribute__((always_inline)) int pa_v_slice(int m, int nv) {
    /* Ternaries, not a loop: the compiler must fold this to a constant before it decides to
     * keep the accumulator arrays in registers (a loop here left them on the stack). */
#define PA_FITS(d) ((m + (m > 1)) * (d) + 1 <= KP_VREGS - 1)
    return PA_FITS(nv) ? nv : PA_FITS(nv / 2) ? nv / 2 : PA_FITS(nv / 4) ? nv / 4
         : PA_FITS(nv / 8) ? nv / 8 : 1;
#undef PA_FITS
}

/* Softmax of one score row of n keys in place (its keys past n, up to `padded`, zeroed: keys of
 * the other, longer row of the tile); returns the sum, and the max in *max. */
static inline float pa_softmax_row(float *sm, int32_t n, int32_t padded, float *max) {
    const int32_t full = n / KP_VW * KP_VW;
    const int tail = n - full;
    vf vmx = vset1(-3.0e38f);
    for (int32_t t = 0; t < full; t += KP_VW) vmx = vmax(vmx, vload(sm + t));
    if (tail) vmx = vmax(vmx, vselect(vlanes_below(tail), vload(sm + full), vmx));
    const float mx = vhmax(vmx);
    vf vsum = vzero();
    for (int32_t t = 0; t < full; t += KP_VW) {
        const vf e = vexp(vload(sm + t) - mx);
        vstore(sm + t, e);
        vsum += e;
    }
    int32_t t = full;
    if (tail) {
        const vf e = vselect(vlanes_below(tail), vexp(vload(sm + full) - mx), vzero());
        vstore(sm + full, e);
        vsum += e;
        t += KP_VW;
    }
    for (; t < padded; t += KP_VW) vstore(sm + t, vzero());
    *max = mx;
    return vhsum(vsum);
}

/* Online softmax (paged_bf16.c, paged_q8.c) over n <= CHUNK scores in p (replaced by exp(s - new max)); `first`: no
 * earlier chunk. Returns the factor that rescales the old sum and accumulator. */
static inline float pa_softmax_step(float *p, int n, int first, float *m, float *l) {
    float mx = p[0];
    for (int t = 1; t < n; ++t) mx = p[t] > mx ? p[t] : mx;
    if (!first && *m > mx) mx = *m;
    const float corr = first ? 0.0f : expf(*m - mx);
    vf sum = vzero();
    int t = 0;
    for (; t + KP_VW <= n; t += KP_VW) {
        const vf e = vexp(vload(p + t) - mx);
        vstore(p + t, e);
        sum += e;
    }
    if (t < n) {
        const vf e = vselect(vlanes_below(n - t), vexp(vload_n(p + t, n - t) - mx), vzero());
        vstore_n(p + t, e, n - t);
        sum += e;
    }
    *l = *l * corr + vhsum(sum);
    *m = mx;
    return corr;
}

/* One head's accumulator a[hd] rescaled by `corr` plus the chunk's n value rows (fp32, row
 * stride hd) weighted by p: the online softmax's value step (paged_bf16.c, paged_q8.c). Four
 * vectors of the head at a time, so four FMA chains run side by side (each lane's sum in the
 * same order either way). */
static inline void pa_accumulate_v(float *a, float corr, const float *p, const float *vbuf,
                                   int n, int hd) {
    int d = 0;
    for (; d + 4 * KP_VW <= hd; d += 4 * KP_VW) {
        vf x0 = vload(a + d) * corr, x1 = vload(a + d + KP_VW) * corr;
        vf x2 = vload(a + d + 2 * KP_VW) * corr, x3 = vload(a + d + 3 * KP_VW) * corr;
        for (int t = 0; t < n; ++t) {
            const vf w = vset1(p[t]);
            const float *v = vbuf + t * hd + d;
            x0 = vfma(w, vload(v), x0);
            x1 = vfma(w, vload(v + KP_VW), x1);
            x2 = vfma(w, vload(v + 2 * KP_VW), x2);
            x3 = vfma(w, vload(v + 3 * KP_VW), x3);
        }
        vstore(a + d, x0);
        vstore(a + d + KP_VW, x1);
        vstore(a + d + 2 * KP_VW, x2);
        vstore(a + d + 3 * KP_VW, x3);
    }
    for (; d + KP_VW <= hd; d += KP_VW) {
        vf x = vload(a + d) * corr;
        for (int t = 0; t < n; ++t) x = vfma(vset1(p[t]), vload(vbuf + t * hd + d), x);
        vstore(a + d, x);
    }
    for (; d < hd; ++d) {
        float x = a[d] * corr;
        for (int t = 0; t < n; ++t) x += p[t] * vbuf[t * hd + d];
        a[d] = x;
    }
}

/* Query heads per tile for R rows: AVX-512 as many as keep the V accumulators of whole heads
 * in registers (head_dim 64: 4 for one row, 3 for two; 128: 2 and 1); AVX2 3 (3 or 6 score
 * rows: enough independent FMAs to hide their latency; its V loop goes over the head in
 * slices either way), measured faster than 1-2 rows and than 4 (BENCHMARKS.md). */
static inline int pa_kt_heads(int R, int hd) {
#if KP_VREGS >= 32
    return hd == 64 ? (R == 1 ? 4 : 3) : (R == 1 ? 2 : 1);
#else
    (void)R;
    (void)hd;
    return 3;
#endif
}

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

/* Rows first .. last share their first `keys` keys, laid out transposed from kt + off with
 * `ld` (keys rounded up to KT_KEYS) keys per head dimension. */
typedef struct {
    int64_t first, last, off, ld;
    int32_t keys;
    int cascade;
} key_group;

/* The denominator's share of an attention sink (gpt-oss: a learned logit per query head that
 * joins the softmax as one more score whose value row is zero) for a head whose running max
 * is m: exp(sink - m), added to the head's sum before the division; 0 without sinks. */
static inline float pa_sink_term(const float *sinks, int head, float m) {
    return sinks ? expf(sinks[head] - m) : 0.0f;
}

/* paged_rows.c: the query-head group of one KV head over keys start .. len - 1, any head_dim
 * up to MAX_HEAD_DIM; softcap > 0 caps the scaled scores with tanh (0: no cap); sinks (or
 * NULL) the group's sink logits (pa_sink_term). */
void pa_item_generic(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                     int32_t len, int kvh, int group, int hd, float scale, float softcap,
                     const float *sinks, float *out);

/* paged_rows.c: KV heads kvh .. kvh + nkv - 1 of one row over keys start .. len - 1, head_dim
 * 64, 128 or 256 (pa_row_head); `state` (or NULL) is the softmax state to go on from (cascade);
 * sinks (or NULL) the sink logits of those query heads. */
void pa_item_vec(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                    int32_t len, int kvh, int nkv, int group, int hd, float scale,
                    const float *state, const float *sinks, float *out);

/* paged_key_tile.c: *buf grown to at least n floats (64-byte aligned; the old contents are
 * not kept), *cap its size; NULL (and *cap 0) when it cannot be allocated. */
float *pa_grow_buffer(float **buf, int64_t *cap, int64_t n);

/* paged_key_tile.c: the calling thread's scratch for n transposed-key floats (kept from call
 * to call), or NULL when it cannot be allocated. */
float *pa_transposed_keys(int64_t n);

/* paged_key_tile.c: keys t0 .. t0 + KT_KEYS - 1 of all KV heads into their places in kt. */
void pa_kt_fill(const kv_layout *kv, const int32_t *table, int32_t len, int nkv, int hd,
                int64_t ld, int32_t t0, float *kt);

/* paged_key_tile.c: KV heads kvh .. kvh + nkv - 1 of R (1 or 2) rows over transposed keys;
 * with `stats`, the unnormalised softmax state goes there instead of a result to out.
 * -1: the score scratch could not be allocated. */
int pa_kt_item(const float *const *q, const float *kt, int64_t ld, const kv_layout *kv,
               const int32_t *table, const int32_t *lens, int R, int kvh, int nkv, int group,
               int hd, float scale, float *const *out, float *const *stats);

/* paged_prefix.c: the groups of rows that share keys, in row order (group_of[r]: row r's
 * group or -1); returns how many. */
int64_t pa_find_key_groups(const int32_t *row_lens, const int64_t *seq_idx,
                           const int32_t *block_tables, int64_t bt_stride, int32_t bs,
                           int64_t n, int cascade, int32_t *group_of, key_group *grp);

/* A bf16 cache (paged_bf16.c, paged_bf16_tile.c): kv_layout over bf16 bits. */
typedef struct {
    const uint16_t *k_base, *v_base;
    int64_t tok_stride;
    int32_t block_size;
} kv16_layout;

/* paged_bf16_tile.c: the prefill runs among n rows (pa_find_key_groups without cascade) and
 * the calling thread's buffer for their keys laid out transposed in bf16 pairs (*kt), to be
 * filled in *slices pieces by pa_kt16_fill (any thread, any order); returns how many runs (0:
 * none, or no memory). Head dims 64 and 128, no window or cap (the caller checks). */
int64_t pa_kt16_plan(const kv16_layout *kv, const int32_t *row_lens, const int64_t *seq_idx,
                     const int32_t *block_tables, int64_t bt_stride, int64_t n, int nkv, int hd,
                     int32_t *group_of, key_group *grp, const uint32_t **kt, int64_t *slices);

/* paged_bf16_tile.c: piece si of pa_kt16_plan's transposed keys. */
void pa_kt16_fill(const kv16_layout *kv, const int64_t *seq_idx, const int32_t *block_tables,
                  int64_t bt_stride, const key_group *grp, int nkv, int hd, const uint32_t *kt,
                  int64_t si);

/* paged_bf16_tile.c: the query heads of KV head kvh for R (1 or 2) rows of a prefill run over
 * the transposed bf16 keys; q[r] and out[r] point at the first of those heads. -1: the score
 * scratch could not be allocated. */
int pa_kt16_item(const uint16_t *const *q, const uint32_t *kt, int64_t ld,
                 const kv16_layout *kv, const int32_t *table, const int32_t *lens, int R, int kvh,
                 int group, int hd, float scale, uint16_t *const *out);

#endif
