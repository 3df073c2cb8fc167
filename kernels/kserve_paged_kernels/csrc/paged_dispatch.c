/* Paged attention, the entry point: kp_paged_rows_f32 spreads the rows over OpenMP threads and
 * sends each to the row kernel (paged_rows.c) or, for rows that share keys, to the transposed
 * keys (paged_key_tile.c, groups from paged_prefix.c). See paged_attention.h. */
#include "paged_attention.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* KV heads kvh .. kvh + nkv - 1 of one row over keys start .. len - 1; q and out point at
 * the first of their heads. A soft-capped layer takes the portable loop (the vector passes
 * have no cap), and so does a head dim other than 64, 128 and 256. */
static void run_item(const float *q, const kv_layout *kv, const int32_t *table, int32_t start,
                     int32_t len, int kvh, int nkv, int group, int hd, float scale,
                     float softcap, const float *sinks, float *out) {
    if (pa_row_head(hd) && nkv * group <= MAX_HEADS && softcap == 0.0f) {
        pa_item_vec(q, kv, table, start, len, kvh, nkv, group, hd, scale, 0, sinks, out);
        return;
    }
    for (int k = 0; k < nkv; ++k)
        pa_item_generic(q + (int64_t)k * group * hd, kv, table, start, len, kvh + k, group, hd,
                        scale, softcap, sinks ? sinks + k * group : 0,
                        out + (int64_t)k * group * hd);
}

/* Attention of n query rows: row r is query row tok_idx[r] of sequence seq_idx[r] (its block
 * table row) and sees the first row_lens[r] keys, the last `window` of them with a window.
 * Output goes to the same rows of out. */
int kp_paged_rows_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t num_blocks,
                      int32_t block_size, int32_t num_kv_heads, int32_t head_dim,
                      int32_t num_heads, const int32_t *block_tables, int64_t bt_stride,
                      const int32_t *row_lens, const int64_t *tok_idx, const int64_t *seq_idx,
                      int64_t n, float scale, int32_t window, float softcap, float *out,
                      int64_t out_row_stride) {
    return kp_paged_rows_sinks_f32(q, q_row_stride, kv, num_blocks, block_size, num_kv_heads,
                                   head_dim, num_heads, block_tables, bt_stride, row_lens,
                                   tok_idx, seq_idx, n, scale, window, softcap, 0, out,
                                   out_row_stride);
}

/* With sinks (one logit per query head, or NULL): rows take the row kernel only (the
 * transposed-key tiles have no sink term). */
int kp_paged_rows_sinks_f32(const float *q, int64_t q_row_stride, const float *kv,
                            int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                            int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                            const int64_t *seq_idx, int64_t n, float scale, int32_t window,
                            float softcap, const float *sinks, float *out,
                            int64_t out_row_stride) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads || window < 0 || !(softcap >= 0.0f))
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

    /* Rows that share keys with others go through the transposed keys (pa_find_key_groups);
     * group_of[r] is row r's group, or -1. Windowed and capped layers do not: a window gives
     * each row its own first key, and those paths have no cap. */
    int32_t *group_of = 0;
    key_group *grp = 0;
    float *kt = 0;
    int64_t groups = 0;
    if (pa_vector_head(head_dim) && n >= 2 && window == 0 && softcap == 0.0f && !sinks) {
        group_of = malloc((size_t)n * sizeof *group_of);
        grp = malloc((size_t)n * sizeof *grp);
        if (group_of && grp)
            groups = pa_find_key_groups(row_lens, seq_idx, block_tables, bt_stride, block_size,
                                        n, per_item == num_kv_heads
                                               && (int64_t)num_kv_heads * group <= MAX_HEADS,
                                        group_of, grp);
        int64_t total = 0, slices = 0;
        for (int64_t k = 0; k < groups; ++k) {
            grp[k].off = total;
            total += grp[k].ld * layout.tok_stride;
            slices += grp[k].ld / KT_KEYS;
        }
        /* Kept by the calling thread from call to call: a fresh buffer per layer would fault
         * its pages in every time. It grows to the largest step's need. */
        if (groups) kt = pa_transposed_keys(total);
        if (!kt) groups = 0;
        if (groups) {  /* fill the transposed keys: items are (group, 16-key slice) */
#pragma omp parallel for schedule(static)
            for (int64_t si = 0; si < slices; ++si) {
                int64_t k = 0, first = 0;
                while (si >= first + grp[k].ld / KT_KEYS) first += grp[k++].ld / KT_KEYS;
                pa_kt_fill(&layout, block_tables + seq_idx[grp[k].first] * bt_stride,
                           grp[k].keys, num_kv_heads, head_dim, grp[k].ld,
                           (int32_t)((si - first) * KT_KEYS), kt + grp[k].off);
            }
        }
    }
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / splits;
        const int kvh = (int)(item % splits) * per_item;
        const int64_t tok = tok_idx[row];
        const float *qh = q + tok * q_row_stride + (int64_t)kvh * group * head_dim;
        float *oh = out + tok * out_row_stride + (int64_t)kvh * group * head_dim;
        const int32_t *table = block_tables + seq_idx[row] * bt_stride;
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
                rc = pa_kt_item(qr, kt + g->off, g->ld, &layout, table, row_lens + row, R, kvh,
                                per_item, group, head_dim, scale, orow, 0);
            } else {
                float state[2][2 * MAX_HEADS + MAX_HEADS * 128];  /* this path: head_dim <= 128 */
                float *st[2] = {state[0], state[1]};
                const int32_t lens[2] = {g->keys, g->keys};
                rc = pa_kt_item(qr, kt + g->off, g->ld, &layout, table, lens, R, kvh, per_item,
                                group, head_dim, scale, orow, st);
                for (int i = 0; i < R && !rc; ++i) {
                    const int32_t *ti = block_tables + seq_idx[row + i] * bt_stride;
                    pa_item_vec(qr[i], &layout, ti, g->keys, row_lens[row + i], kvh,
                                per_item, group, head_dim, scale, st[i], 0, orow[i]);
                }
            }
            if (rc) {
#pragma omp atomic write
                failed = 1;
            }
            continue;
        }
        const int32_t len = row_lens[row];
        const int32_t start = (window > 0 && len > window) ? len - window : 0;
        run_item(qh, &layout, table, start, len, kvh, per_item, group, head_dim, scale, softcap,
                 sinks ? sinks + kvh * group : 0, oh);
    }
    free(group_of);
    free(grp);
    if (failed) return -2;
    return 0;
}
