/* Paged attention over a quantized KV cache (one-byte codes, a scale per block and KV head):
 * kp_paged_rows_q8 (kp_native.h).
 *
 * Why: the CPU backend used to dequantize every block a step reads into a float copy in
 * PyTorch and run the float kernel over the copy (write 4 bytes per element, read them again),
 * which made a quantized cache about three times slower than a float32 one. Here a decode row
 * reads the codes themselves: a quarter of float32's bytes.
 *
 * A single row of a sequence (a decode token) is a work item per (row, KV head): head dims
 * 64, 128 and 256 in spans (paged_span.h, as the bf16 kernel: codes widened in registers,
 * kp_kvq.h, exact), others in chunks of CHUNK keys whose K and V codes are widened into fp32
 * scratch that stays in L1, so every query head of the group reads them at fp32 speed. A key's scale (times the softmax scale) multiplies its
 * score, a value's scale its softmax weight, so the per-element work is the widening alone.
 * Scores, the online softmax and the sums are fp32.
 *
 * Rows of a sequence that has several in the call (a prefill chunk, which the key tiles of the
 * fp32 kernel make fast) go another way: that sequence's blocks are dequantized once into fp32
 * scratch (code * scale, the same products as kernels/kserve_paged_kernels/kv_quant.py's dequantize) and the fp32
 * kernel, kp_paged_rows_f32, runs over it. Each row there reads its context many times, so
 * widening it once is cheaper than once per row.
 */
#include "paged_span.h"

#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const uint8_t *k_base, *v_base;  /* codes of the K and V halves */
    const float *k_scale, *v_scale;  /* [num_blocks, heads] of each half */
    int64_t tok_stride;              /* heads * head_dim */
    int32_t block_size, heads, fmt;
} q8_layout;

/* scale * q.k for the n <= CHUNK widened keys in kbuf (rows of hd), times each key's kmul. */
static inline void scores(const float *q, const float *kbuf, const float *kmul, int n, int hd,
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
            vstore(p + t, vhsum_lanes(part) * vload(kmul + t));
        }
    }
    for (; t < n; ++t) {
        const float *k = kbuf + (int64_t)t * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; ++d) s += q[d] * k[d];
        p[t] = s * kmul[t];
    }
}

/* The query heads of KV head kvh (q, out: the first of them) over keys start .. len - 1. */
static void item_q8(const float *q, const q8_layout *kv, const int32_t *table, int32_t start,
                    int32_t len, int kvh, int group, int hd, float scale, float softcap,
                    float *out) {
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float kbuf[CHUNK * MAX_HEAD_DIM], vbuf[CHUNK * MAX_HEAD_DIM];
    float p[CHUNK], kmul[CHUNK], vmul[CHUNK], m[MAX_GROUP], l[MAX_GROUP];
    const int32_t bs = kv->block_size;
    const float unit = kvq_unit(kv->fmt);
    for (int g = 0; g < group; ++g) {
        for (int d = 0; d < hd; ++d) acc[g * hd + d] = 0.0f;
        m[g] = 0.0f;
        l[g] = 0.0f;
    }
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (int32_t c0 = start; c0 < len; c0 += CHUNK) {
        const int n = (len - c0) < CHUNK ? (len - c0) : CHUNK;
        /* Pull the next chunk's codes toward L2 (scattered blocks: the hardware prefetchers
         * cannot guess them). */
        for (int32_t pos = c0 + CHUNK; pos < len && pos < c0 + 2 * CHUNK; ++pos) {
            const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * kv->tok_stride
                                + (int64_t)kvh * hd;
            for (int b = 0; b < hd; b += 64) {
                __builtin_prefetch(kv->k_base + off + b, 0, 2);
                __builtin_prefetch(kv->v_base + off + b, 0, 2);
            }
        }
        for (int t = 0; t < n; ++t) {
            const int32_t pos = c0 + t;
            const int64_t blk = table[pos / bs];
            const int64_t off = (blk * bs + pos % bs) * kv->tok_stride + (int64_t)kvh * hd;
            kmul[t] = kv->k_scale[blk * kv->heads + kvh] * unit * scale;
            vmul[t] = kv->v_scale[blk * kv->heads + kvh] * unit;
            kvq_widen_row(kv->k_base + off, kbuf + (int64_t)t * hd, hd, kv->fmt, 1.0f);
            kvq_widen_row(kv->v_base + off, vbuf + (int64_t)t * hd, hd, kv->fmt, 1.0f);
        }
        for (int g = 0; g < group; ++g) {
            scores(q + (int64_t)g * hd, kbuf, kmul, n, hd, p);
            if (softcap > 0.0f)
                for (int t = 0; t < n; ++t) p[t] = softcap * tanhf(p[t] * inv_cap);
            const float corr = pa_softmax_step(p, n, c0 == start, &m[g], &l[g]);
            for (int t = 0; t < n; ++t) p[t] *= vmul[t];  /* the value's scale, after the sum */
            pa_accumulate_v(acc + (int64_t)g * hd, corr, p, vbuf, n, hd);
        }
    }
    for (int g = 0; g < group; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < hd; ++d) out[(int64_t)g * hd + d] = acc[g * hd + d] * inv;
    }
}

/* item_q8 for head dim HD (64, 128 or 256): in spans (paged_span.h), q and the accumulators
 * fp32 in their natural order. */
static inline __attribute__((always_inline)) void item_span(
    const float *q, const q8_layout *q8, const int32_t *table, int32_t start, int32_t len,
    int kvh, int group, const int HD, float scale, float softcap, float *out, const int FMT) {
    float acc[MAX_GROUP * MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    const span_cache kv = {q8->k_base, q8->v_base, q8->k_scale, q8->v_scale, q8->tok_stride,
                           q8->block_size, q8->heads, kvq_unit(FMT)};
    for (int i = 0; i < group * HD; ++i) acc[i] = 0.0f;
    for (int g = 0; g < group; ++g) m[g] = l[g] = 0.0f;
    span_item(0, q, &kv, table, start, len, kvh, group, HD, scale, softcap, acc, m, l, FMT);
    for (int g = 0; g < group; ++g) {
        const vf inv = vset1(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int d = 0; d < HD; d += KP_VW)
            vstore(out + (int64_t)g * HD + d, vload(acc + g * HD + d) * inv);
    }
}

/* One (row, KV head): the spans for head dims 64, 128 and 256 (a function per format and head
 * dim, so each is specialised), item_q8 for the others. */
#define SPAN_FN(NAME, HD, FMT)                                                                  \
    static void NAME(const float *q, const q8_layout *kv, const int32_t *table, int32_t start, \
                     int32_t len, int kvh, int group, float scale, float softcap, float *out) { \
        item_span(q, kv, table, start, len, kvh, group, HD, scale, softcap, out, FMT);          \
    }
#define SPAN_FNS(FMT, SUF) SPAN_FN(span64##SUF, 64, FMT) SPAN_FN(span128##SUF, 128, FMT)         \
    SPAN_FN(span256##SUF, 256, FMT)
SPAN_FNS(KP_KV_INT8, _i8)
SPAN_FNS(KP_KV_E4M3, _e4)
SPAN_FNS(KP_KV_E5M2, _e5)
#undef SPAN_FNS
#undef SPAN_FN

typedef void (*span_fn)(const float *, const q8_layout *, const int32_t *, int32_t, int32_t, int,
                        int, float, float, float *);

static void row_item(const float *q, const q8_layout *kv, const int32_t *table, int32_t start,
                     int32_t len, int kvh, int group, int hd, float scale, float softcap,
                     float *out) {
    static const span_fn fns[3][3] = {{span64_i8, span128_i8, span256_i8},
                                      {span64_e4, span128_e4, span256_e4},
                                      {span64_e5, span128_e5, span256_e5}};
    const int which = hd == 64 ? 0 : hd == 128 ? 1 : hd == 256 ? 2 : -1;
    if (which < 0)
        item_q8(q, kv, table, start, len, kvh, group, hd, scale, softcap, out);
    else
        fns[kv->fmt - KP_KV_INT8][which](q, kv, table, start, len, kvh, group, scale, softcap,
                                         out);
}

/* The calling thread's fp32 scratch for dequantized blocks (kept from call to call, like the
 * transposed keys: a fresh buffer per layer would fault its pages in every time). */
static __thread float *dq_buf;
static __thread int64_t dq_cap;

/* Rows r of a run (several consecutive rows of one sequence: want[r]) through
 * kp_paged_rows_f32 over their sequences' blocks dequantized into scratch. */
static int run_compact(const float *q, int64_t q_row_stride, const q8_layout *kv,
                       int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *row_lens, const int64_t *tok_idx,
                       const int64_t *seq_idx, const uint8_t *want, int64_t n, float scale,
                       int32_t window, float softcap, float *out, int64_t out_row_stride) {
    const int32_t bs = kv->block_size, H = kv->heads;
    int64_t nr = 0, runs = 0, total = 0, widest = 0;
    for (int64_t r = 0; r < n; ++r) nr += want[r];
    int32_t *lens = malloc((size_t)nr * sizeof *lens);
    int64_t *tok = malloc((size_t)nr * sizeof *tok), *seq = malloc((size_t)nr * sizeof *seq);
    int64_t *run_seq = malloc((size_t)nr * sizeof *run_seq);
    int64_t *run_blocks = malloc((size_t)nr * sizeof *run_blocks);
    int rc = -2;
    if (!lens || !tok || !seq || !run_seq || !run_blocks) goto done;
    for (int64_t r = 0, i = 0; r < n; ++r) {
        if (!want[r]) continue;
        if (!i || !want[r - 1] || seq_idx[r - 1] != seq_idx[r]) {
            run_seq[runs] = seq_idx[r];
            run_blocks[runs++] = 0;
        }
        const int64_t nb = (row_lens[r] + bs - 1) / bs;
        if (nb > run_blocks[runs - 1]) run_blocks[runs - 1] = nb;
        lens[i] = row_lens[r];
        tok[i] = tok_idx[r];
        seq[i++] = runs - 1;
    }
    for (int64_t k = 0; k < runs; ++k) {
        total += run_blocks[k];
        widest = run_blocks[k] > widest ? run_blocks[k] : widest;
    }
    const int64_t block_floats = (int64_t)bs * kv->tok_stride;
    float *cache = pa_grow_buffer(&dq_buf, &dq_cap, 2 * total * block_floats + 1);
    int32_t *tables = malloc((size_t)(runs * widest + 1) * sizeof *tables);
    if (!cache || !tables) {
        free(tables);
        goto done;
    }
    for (int64_t k = 0, base = 0; k < runs; base += run_blocks[k++])
        for (int64_t j = 0; j < run_blocks[k]; ++j) tables[k * widest + j] = (int32_t)(base + j);
    const float unit = kvq_unit(kv->fmt);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < total; ++c) {  /* compact block c: run k, its block j */
        int64_t k = 0, first = 0;
        while (c >= first + run_blocks[k]) first += run_blocks[k++];
        const int64_t phys = block_tables[run_seq[k] * bt_stride + (c - first)];
        for (int half = 0; half < 2; ++half) {
            const uint8_t *src = (half ? kv->v_base : kv->k_base) + phys * block_floats;
            const float *sc = (half ? kv->v_scale : kv->k_scale) + phys * H;
            float *dst = cache + half * total * block_floats + c * block_floats;
            for (int32_t s = 0; s < bs; ++s)
                for (int h = 0; h < H; ++h) {
                    const int64_t o = ((int64_t)s * H + h) * head_dim;
                    kvq_widen_row(src + o, dst + o, head_dim, kv->fmt, unit * sc[h]);
                }
        }
    }
    rc = kp_paged_rows_f32(q, q_row_stride, cache, total, bs, H, head_dim, num_heads, tables,
                           widest, lens, tok, seq, nr, scale, window, softcap, out,
                           out_row_stride);
    free(tables);
done:
    free(lens);
    free(tok);
    free(seq);
    free(run_seq);
    free(run_blocks);
    return rc;
}

int kp_paged_rows_q8(const float *q, int64_t q_row_stride, const uint8_t *codes,
                     const float *scales, int32_t format, int64_t num_blocks, int32_t block_size,
                     int32_t num_kv_heads, int32_t head_dim, int32_t num_heads,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *row_lens,
                     const int64_t *tok_idx, const int64_t *seq_idx, int64_t n, float scale,
                     int32_t window, float softcap, float *out, int64_t out_row_stride) {
    if (num_kv_heads <= 0 || head_dim <= 0 || num_heads % num_kv_heads) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        block_size > MAX_BLOCK || window < 0 || !(softcap >= 0.0f) || format < KP_KV_INT8 ||
        format > KP_KV_E5M2)
        return -1;
    if (n <= 0) return 0;
    q8_layout kv;
    kv.tok_stride = (int64_t)num_kv_heads * head_dim;
    kv.k_base = codes;
    kv.v_base = codes + num_blocks * (int64_t)block_size * kv.tok_stride;
    kv.k_scale = scales;
    kv.v_scale = scales + num_blocks * (int64_t)num_kv_heads;
    kv.block_size = block_size;
    kv.heads = num_kv_heads;
    kv.fmt = format;
    /* run[r]: row r shares its sequence with a neighbour (rows of a sequence are adjacent). */
    uint8_t *run = malloc((size_t)n);
    if (!run) return -2;
    int64_t runs = 0;
    for (int64_t r = 0; r < n; ++r) {
        run[r] = (r > 0 && seq_idx[r - 1] == seq_idx[r]) || (r + 1 < n && seq_idx[r + 1] == seq_idx[r]);
        runs += run[r];
    }
    int rc = 0;
    if (runs)
        rc = run_compact(q, q_row_stride, &kv, head_dim, num_heads, block_tables, bt_stride,
                         row_lens, tok_idx, seq_idx, run, n, scale, window, softcap, out,
                         out_row_stride);
    const int64_t items = n * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / num_kv_heads;
        if (rc || run[row]) continue;
        const int kvh = (int)(item % num_kv_heads);
        const int64_t head0 = (int64_t)kvh * group * head_dim;
        const int32_t len = row_lens[row];
        const int32_t start = (window > 0 && len > window) ? len - window : 0;
        row_item(q + tok_idx[row] * q_row_stride + head0, &kv,
                 block_tables + seq_idx[row] * bt_stride, start, len, kvh, group, head_dim,
                 scale, softcap, out + tok_idx[row] * out_row_stride + head0);
    }
    free(run);
    return rc;
}
