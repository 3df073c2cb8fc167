/* Paged attention: which rows share keys (paged_attention.h). Rows found here go through the
 * transposed keys of paged_key_tile.c; the others through the row kernel. */
#include "paged_attention.h"

#ifndef CASCADE_MIN_ROWS
#define CASCADE_MIN_ROWS 8
#endif
#ifndef CASCADE_MIN_BLOCKS
#define CASCADE_MIN_BLOCKS 8
#endif
#ifndef KT_MIN_ROWS  /* a huge value turns the path off (bench/probes/prefill_attention.py) */
#define KT_MIN_ROWS 32
#endif

/* The groups of rows that share keys, in row order; group_of[r] gets each row's group or -1:
 * - prefill runs: at least KT_MIN_ROWS rows of one sequence at consecutive positions (all
 *   keys of the run's last row);
 * - with `cascade`, among the other rows: at least CASCADE_MIN_ROWS consecutive rows of
 *   different sequences whose block tables start with the same CASCADE_MIN_BLOCKS or more full
 *   blocks (a shared prompt prefix; the full blocks before each row's last key). The prefix is
 *   done once per group, two rows at a time; each row then goes on over its own keys from the
 *   softmax state the prefix left. */
int64_t pa_find_key_groups(const int32_t *row_lens, const int64_t *seq_idx,
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
    for (int64_t k = 0; k < groups; ++k)
        grp[k].ld = ((int64_t)grp[k].keys + KT_KEYS - 1) / KT_KEYS * KT_KEYS;
    return groups;
}
