/* Prefill tiles over a bf16 KV cache: the rows of a prefill run (paged_prefix.c) share their
 * keys, so, as paged_key_tile.c does in fp32, each KV head's keys are laid out transposed once
 * per call and a row's scores come out KT_KEYS keys at a time, two rows and several query
 * heads sharing every K and V load.
 *
 * Why: bf16 prefill went to SDPA (a block gather per sequence, then torch's kernel), while the
 * fp32 tiles beat SDPA (BENCHMARKS.md).
 *
 * The transposed keys stay bf16, in pairs: [head][group of KT_KEYS keys][head_dim / 2][KT_KEYS]
 * 32-bit lanes, each holding dims 2i and 2i + 1 of one key. That is the operand layout of
 * `vdpbf16ps` (AVX512-BF16: lane += a.lo * b.lo + a.hi * b.hi in fp32), so at the avx512_bf16
 * and amx levels a query pair broadcast to every lane multiplies 16 keys in one instruction.
 * Elsewhere each lane is split exactly into its two fp32 halves (shift, mask) and takes two
 * FMAs. Products of two bf16 are exact in fp32 either way: only the order of the fp32 sums
 * differs. The softmax is fp32 over the whole score row, V rows are widened as they are read,
 * and each output is rounded to bf16 once (nearest even). */
#include <string.h>

#include "kp_bf16.h"
#include "paged_attention.h"

#if defined(__AVX512BF16__) && KP_VW == 16
#define KT16_DOT 1
#else
#define KT16_DOT 0
#endif

typedef int32_t vi_unaligned __attribute__((vector_size(4 * KP_VW), aligned(4), may_alias));

/* Keys t0 .. t0 + KT_KEYS - 1 (t0 a multiple of KT_KEYS) of all nkv heads into their places in
 * kt, in pairs (zero past len). */
static void kt16_fill(const kv16_layout *kv, const int32_t *table, int32_t len, int nkv, int hd,
                      int64_t ld, int32_t t0, uint32_t *kt) {
    const int32_t bs = kv->block_size;
    const int hp = hd / 2;
    for (int h = 0; h < nkv; ++h) {
        uint32_t *dst = kt + (int64_t)h * hp * ld + (int64_t)t0 * hp;  /* [hp][KT_KEYS] */
        for (int32_t t = t0; t < t0 + KT_KEYS; ++t) {
            uint32_t *col = dst + (t - t0);
            if (t < len) {
                const uint16_t *src = kv->k_base + ((int64_t)table[t / bs] * bs + t % bs)
                                      * kv->tok_stride + (int64_t)h * hd;
                for (int i = 0; i < hp; ++i) {
                    uint32_t pair;
                    memcpy(&pair, src + 2 * i, sizeof pair);
                    col[i * KT_KEYS] = pair;
                }
            } else {
                for (int i = 0; i < hp; ++i) col[i * KT_KEYS] = 0;
            }
        }
    }
}

int64_t pa_kt16_plan(const kv16_layout *kv, const int32_t *row_lens, const int64_t *seq_idx,
                     const int32_t *block_tables, int64_t bt_stride, int64_t n, int nkv, int hd,
                     int32_t *group_of, key_group *grp, const uint32_t **kt, int64_t *slices) {
    int64_t groups = pa_find_key_groups(row_lens, seq_idx, block_tables, bt_stride,
                                        kv->block_size, n, 0, group_of, grp);
    int64_t total = 0;
    *slices = 0;
    for (int64_t k = 0; k < groups; ++k) {
        grp[k].off = total;
        total += grp[k].ld * nkv * (hd / 2);
        *slices += grp[k].ld / KT_KEYS;
    }
    /* The calling thread's buffer, as fp32's (pa_transposed_keys): a float per pair. */
    uint32_t *buf = groups ? (uint32_t *)pa_transposed_keys(total) : 0;
    *kt = buf;
    if (!buf) *slices = 0;
    return buf ? groups : 0;
}

void pa_kt16_fill(const kv16_layout *kv, const int64_t *seq_idx, const int32_t *block_tables,
                  int64_t bt_stride, const key_group *grp, int nkv, int hd, const uint32_t *kt,
                  int64_t si) {
    int64_t k = 0, first = 0;
    while (si >= first + grp[k].ld / KT_KEYS) first += grp[k++].ld / KT_KEYS;
    kt16_fill(kv, block_tables + seq_idx[grp[k].first] * bt_stride, grp[k].keys, nkv, hd,
              grp[k].ld, (int32_t)((si - first) * KT_KEYS), (uint32_t *)kt + grp[k].off);
}

/* Scores of key group `col` ([hd / 2][KT_KEYS] pairs) for M query rows, scaled, to s + m * ld.
 * qp: the rows' bf16 pairs (dot level) or widened values (others). */
static inline __attribute__((always_inline)) void kt16_scores(
    const uint32_t *col, const void *qrows, int M, int hd, float scale, float *s, int64_t ld) {
    vf acc[MAX_M][KV_VECS];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < KV_VECS; ++c) acc[m][c] = vzero();
#if KT16_DOT
    const uint32_t *qp = qrows;
    for (int i = 0; i < hd / 2; ++i) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(col + (int64_t)i * KT_KEYS);
        for (int m = 0; m < M; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0],
                                         (__m512bh)_mm512_set1_epi32((int)qp[m * hd / 2 + i]), k);
    }
#else
    const float *qf = qrows;
    for (int i = 0; i < hd / 2; ++i) {
        vf lo[KV_VECS], hi[KV_VECS];
        for (int c = 0; c < KV_VECS; ++c) {
            const vi w = *(const vi_unaligned *)(col + (int64_t)i * KT_KEYS + c * KP_VW);
            lo[c] = (vf)(w << 16);      /* dim 2i: the low half, shifted up */
            hi[c] = (vf)(w & -65536);   /* dim 2i + 1: the high half, low bits cleared */
        }
        for (int m = 0; m < M; ++m) {
            const vf a = vset1(qf[m * hd + 2 * i]), b = vset1(qf[m * hd + 2 * i + 1]);
            for (int c = 0; c < KV_VECS; ++c) acc[m][c] = vfma(b, hi[c], vfma(a, lo[c], acc[m][c]));
        }
    }
#endif
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < KV_VECS; ++c) vstore(s + m * ld + c * KP_VW, acc[m][c] * scale);
}

/* Query heads g0 .. g0 + gb - 1 of KV head h for R rows over their first lens[r] keys (as
 * paged_key_tile.c's kt_tile): M = R * gb score rows, each with its own softmax; the V loop
 * keeps DV vectors of each accumulator in registers and walks the head in slices of DV. */
static inline __attribute__((always_inline)) void kt16_tile(
    const uint16_t *const *q, const uint32_t *kt, int64_t ld, const kv16_layout *kv,
    const int32_t *table, const int32_t *lens, int h, const int R, const int gb, const int NV,
    float scale, float *s, uint16_t *const *out) {
    const int hd = KP_VW * NV;
    const int M = R * gb;
    const int32_t bs = kv->block_size;
    const int32_t len = lens[R - 1] > lens[0] ? lens[R - 1] : lens[0];  /* the longer row */
#if KT16_DOT
    uint32_t qrows[MAX_M * 64];
    for (int m = 0; m < M; ++m)
        memcpy(qrows + m * hd / 2, q[m / gb] + (int64_t)(m % gb) * hd, (size_t)hd * 2);
#else
    float qrows[MAX_M * 128] __attribute__((aligned(64)));
    for (int m = 0; m < M; ++m)
        for (int d = 0; d < hd; ++d) qrows[m * hd + d] = bf16_to_f32(q[m / gb][(m % gb) * hd + d]);
#endif
    const uint32_t *kh = kt + (int64_t)h * (hd / 2) * ld;
    const int32_t groups = (len + KT_KEYS - 1) / KT_KEYS;
    for (int32_t j = 0; j < groups; ++j)
        kt16_scores(kh + (int64_t)j * KT_KEYS * (hd / 2), qrows, M, hd, scale,
                    s + (int64_t)j * KT_KEYS, ld);
    float inv[MAX_M];
    for (int m = 0; m < M; ++m) {
        float mx;
        inv[m] = 1.0f / pa_softmax_row(s + m * ld, lens[m / gb], groups * KT_KEYS, &mx);
    }
    const int DV = pa_v_slice(M, NV);
    for (int j0 = 0; j0 < NV; j0 += DV) {
        vf a[MAX_M][MAX_NV];
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < DV; ++j) a[m][j] = vzero();
        for (int32_t t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
            const uint16_t *base = kv->v_base + (int64_t)table[b] * bs * kv->tok_stride
                                   + (int64_t)h * hd + KP_VW * j0;
            const int32_t nu = (len - t0) < bs ? (len - t0) : bs;
            for (int32_t u = 0; u < nu; ++u) {
                const uint16_t *vt = base + (int64_t)u * kv->tok_stride;
                vf v[MAX_NV];
                for (int j = 0; j < DV; ++j) v[j] = vload_bf16(vt + KP_VW * j);
                for (int m = 0; m < M; ++m) {
                    const vf w = vset1(s[m * ld + t0 + u]);
                    for (int j = 0; j < DV; ++j) a[m][j] = vfma(w, v[j], a[m][j]);
                }
            }
        }
        for (int m = 0; m < M; ++m) {
            uint16_t *o = out[m / gb] + (int64_t)(m % gb) * hd + KP_VW * j0;
            for (int j = 0; j < DV; ++j) {
                float r[KP_VW];
                vstore(r, a[m][j] * inv[m]);
                for (int i = 0; i < KP_VW; ++i) o[KP_VW * j + i] = f32_to_bf16(r[i]);
            }
        }
    }
}

/* kt16_tile with R, gb and the head dim as constants. */
static void kt16_dispatch(const uint16_t *const *q, const uint32_t *kt, int64_t ld,
                          const kv16_layout *kv, const int32_t *table, const int32_t *lens, int h,
                          int R, int gb, int hd, float scale, float *s, uint16_t *const *out) {
#define KT(RR, GB, NV) kt16_tile(q, kt, ld, kv, table, lens, h, RR, GB, NV, scale, s, out)
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

static __thread float *kt16_scores_buf;  /* a worker's score rows */
static __thread int64_t kt16_scores_cap;

int pa_kt16_item(const uint16_t *const *q, const uint32_t *kt, int64_t ld,
                 const kv16_layout *kv, const int32_t *table, const int32_t *lens, int R, int kvh,
                 int group, int hd, float scale, uint16_t *const *out) {
    const int per_pass = pa_kt_heads(R, hd);
    float *s = pa_grow_buffer(&kt16_scores_buf, &kt16_scores_cap, (int64_t)MAX_M * ld);
    if (!s) return -1;
    for (int g = 0; g < group; g += per_pass) {
        const int gb = (group - g) < per_pass ? (group - g) : per_pass;
        const int64_t off = (int64_t)g * hd;
        const uint16_t *qg[2] = {q[0] + off, R > 1 ? q[1] + off : 0};
        uint16_t *og[2] = {out[0] + off, R > 1 ? out[1] + off : 0};
        kt16_dispatch(qg, kt, ld, kv, table, lens, kvh, R, gb, hd, scale, s, og);
    }
    return 0;
}
