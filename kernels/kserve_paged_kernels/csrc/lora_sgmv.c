/* LoRA delta of one projection for a whole step's rows, grouped by adapter (kp_native.h).
 *
 * Segment s is a run of rows that use the adapter in slot seg_slot[s]. Each row's shrink
 * (rank dot products over in_dim) goes to a small scratch row, then its expand adds
 * scale * B @ t into the row's output, B read rank-major (B^T, each of its rows contiguous). A and B of one adapter are a few tens of KiB, so they
 * stay in cache across the segment's rows: per row this is a GEMV at full cache speed, and
 * the whole step is one call instead of a gather, two matmuls and a scatter per adapter.
 */
#include <stdlib.h>

#include "kp_native.h"

/* Below this many multiply-adds a call runs on the calling thread: a parallel region costs
 * more than a decode step's delta. */
#define LORA_PAR_MIN_WORK (1 << 18)

int kp_lora_sgmv_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                     const float *a, const float *b_t, const float *scales, int64_t slots,
                     int64_t rank, int64_t in_dim, int64_t out_dim, int64_t x_rows,
                     const int64_t *rows, int64_t num_rows, const int64_t *seg_start,
                     const int64_t *seg_len, const int64_t *seg_slot, int64_t num_segs) {
    if (rank <= 0 || rank > KP_LORA_MAX_RANK) return -2;
    for (int64_t s = 0; s < num_segs; s++) {
        if (seg_slot[s] < 0 || seg_slot[s] >= slots || seg_start[s] < 0 || seg_len[s] < 0
            || seg_start[s] + seg_len[s] > num_rows)
            return -1;
    }
    for (int64_t r = 0; r < num_rows; r++)
        if (rows[r] < 0 || rows[r] >= x_rows) return -1;
    /* Row r of `rows` -> its segment's slot; rows outside every segment are left alone. */
    int64_t *row_slot = malloc((size_t)(num_rows > 0 ? num_rows : 1) * sizeof(int64_t));
    if (!row_slot) return -3;
    for (int64_t r = 0; r < num_rows; r++) row_slot[r] = -1;
    for (int64_t s = 0; s < num_segs; s++)
        for (int64_t r = seg_start[s]; r < seg_start[s] + seg_len[s]; r++)
            row_slot[r] = seg_slot[s];
    const int64_t work = num_rows * rank * (in_dim + out_dim);
#pragma omp parallel for schedule(static) if (work >= LORA_PAR_MIN_WORK)
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t slot = row_slot[r];
        if (slot < 0) continue;
        const float *xr = x + rows[r] * x_stride;
        float *yr = out + rows[r] * out_stride;
        const float *as = a + slot * rank * in_dim;
        const float *bs = b_t + slot * rank * out_dim;
        float t[KP_LORA_MAX_RANK];
        for (int64_t k = 0; k < rank; k++) {
            const float *ak = as + k * in_dim;
            float acc = 0.0f;
            for (int64_t i = 0; i < in_dim; i++) acc += ak[i] * xr[i];
            t[k] = acc * scales[slot];
        }
        /* Rank-major B: each k adds a scaled contiguous row, which vectorises over j; a zero
         * t[k] (a rank padded to the slot stack's) adds nothing. */
        for (int64_t k = 0; k < rank; k++) {
            const float *bk = bs + k * out_dim;
            const float tk = t[k];
            if (tk == 0.0f) continue;
            for (int64_t j = 0; j < out_dim; j++) yr[j] += tk * bk[j];
        }
    }
    free(row_slot);
    return 0;
}
