/* The store of a quantized KV cache: kp_store_kv_q8 (kp_native.h), kernels/kserve_paged_kernels/kv_quant.py's
 * store_kv_quant in one native pass per K/V half.
 *
 * Why: the PyTorch store is a dozen indexed tensor ops per half and layer (reset, amax,
 * scatter-reduce, a growth check that syncs, requantize, encode, scatter), a large share of a
 * small decode step. Here each row is read once.
 *
 * Same codes as the PyTorch store, bit for bit: the same order (reset the scales of blocks
 * written at their first slot, take each (block, head)'s new scale as the largest of its old
 * one and the rows' |x| / qmax, requantize a (block, head) that grew once, then encode the
 * rows), and the same fp32 operations. The arithmetic functions are compiled without
 * -ffast-math so that a division stays a division (fast-math may turn x / 127 into x * (1 /
 * 127), one rounding off) and rounding is to nearest even, as torch's.
 */
#include <stdlib.h>
#include <string.h>

#include "kp_kvq.h"

#define EXACT __attribute__((optimize("no-fast-math")))

/* |x| <= the format's largest value, already divided by the scale -> its fp8 code (mbits
 * mantissa bits, exponent bias `bias`), rounded to nearest even as torch's cast. */
static EXACT uint8_t to_fp8(float x, int mbits, int bias) {
    union { float f; uint32_t u; } c = {x};
    const uint32_t sign = (c.u >> 24) & 0x80u, a = c.u & 0x7fffffffu;
    if (a == 0) return (uint8_t)sign;
    const int e = (int)(a >> 23) - 127;
    if (e < 1 - bias)  /* below the format's normal range: count its smallest steps */
        return (uint8_t)(sign | (uint32_t)nearbyintf(ldexpf(fabsf(x), bias - 1 + mbits)));
    const int shift = 23 - mbits;
    uint32_t r = a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u);
    r = (r >> shift) - ((uint32_t)(127 - bias) << mbits);  /* rebias the exponent */
    return (uint8_t)(sign | r);
}

/* float x already divided by its scale -> the code (clamped to the format's range). */
static EXACT uint8_t encode(float x, int fmt) {
    const float qmax = kvq_qmax(fmt);
    x = x < -qmax ? -qmax : x > qmax ? qmax : x;
    if (fmt == KP_KV_INT8) return (uint8_t)(int8_t)nearbyintf(x);
    return fmt == KP_KV_E4M3 ? to_fp8(x, 3, 7) : to_fp8(x, 2, 15);
}

static EXACT float div_exact(float a, float b) { return a / b; }
static EXACT float mul_exact(float a, float b) { return a * b; }

/* The value of a code over its scale (kvq_widen1 times the format's unit). */
static inline float decode(uint8_t b, int fmt) { return kvq_widen1(b, fmt) * kvq_unit(fmt); }

typedef struct {
    uint8_t *codes;   /* this half's [num_blocks, block_size, heads, hd] */
    float *scales;    /* this half's [num_blocks, heads] */
    int32_t bs, heads, hd, fmt;
} half_cache;

/* Requantize the codes of (block b, head h) from scale `old` to `new` (both > 0). */
static EXACT void requantize(const half_cache *c, int64_t b, int h, float old, float new) {
    const float ratio = old / new;
    for (int32_t s = 0; s < c->bs; ++s) {
        uint8_t *p = c->codes + ((b * c->bs + s) * c->heads + h) * (int64_t)c->hd;
        for (int d = 0; d < c->hd; ++d) p[d] = encode(decode(p[d], c->fmt) * ratio, c->fmt);
    }
}

/* Whether row t is the first of the call in its block (rows of one block need one requantize;
 * a block's rows are normally adjacent, so the scan back stops at once). */
static int first_in_block(const int64_t *slots, int64_t t, int32_t bs) {
    const int64_t b = slots[t] / bs;
    for (int64_t u = t - 1; u >= 0; --u)
        if (slots[u] >= 0 && slots[u] / bs == b) return 0;
    return 1;
}

static EXACT void store_half(const half_cache *c, const float *x, int64_t stride,
                             const int64_t *slots, int64_t n, float *old) {
    const int H = c->heads, hd = c->hd;
    const float qmax = kvq_qmax(c->fmt);
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= 0 && slots[t] % c->bs == 0)
            memset(c->scales + slots[t] / c->bs * H, 0, (size_t)H * sizeof(float));
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= 0) memcpy(old + t * H, c->scales + slots[t] / c->bs * H, H * sizeof(float));
    for (int64_t t = 0; t < n; ++t) {
        if (slots[t] < 0) continue;
        float *sc = c->scales + slots[t] / c->bs * H;
        for (int h = 0; h < H; ++h) {
            const float *xr = x + t * stride + (int64_t)h * hd;
            float amax = 0.0f;
            for (int d = 0; d < hd; ++d) amax = fabsf(xr[d]) > amax ? fabsf(xr[d]) : amax;
            const float need = div_exact(amax, qmax);
            if (need > sc[h]) sc[h] = need;
        }
    }
    for (int64_t t = 0; t < n; ++t) {
        if (slots[t] < 0) continue;
        const int64_t b = slots[t] / c->bs;
        const float *sc = c->scales + b * H;
        int first = -1;  /* computed when first needed */
        for (int h = 0; h < H; ++h) {
            if (!(sc[h] > old[t * H + h] && old[t * H + h] > 0.0f)) continue;
            if (first < 0) first = first_in_block(slots, t, c->bs);
            if (first) requantize(c, b, h, old[t * H + h], sc[h]);
        }
        uint8_t *dst = c->codes + slots[t] * (int64_t)H * hd;
        for (int h = 0; h < H; ++h) {
            const float inv = sc[h] > 0.0f ? div_exact(1.0f, sc[h] > 1e-30f ? sc[h] : 1e-30f) : 0.0f;
            const float *xr = x + t * stride + (int64_t)h * hd;
            for (int d = 0; d < hd; ++d) dst[h * hd + d] = encode(mul_exact(xr[d], inv), c->fmt);
        }
    }
}

int kp_store_kv_q8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                   const int64_t *slots, int64_t n, uint8_t *codes, float *scales,
                   int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                   int32_t head_dim, int32_t format) {
    const int64_t num_slots = num_blocks * block_size;
    if (format < KP_KV_INT8 || format > KP_KV_E5M2 || block_size <= 0) return -1;
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= num_slots) return -1;
    if (n <= 0) return 0;
    float *old = malloc((size_t)n * num_kv_heads * sizeof(float));
    if (!old) return -2;
    for (int half = 0; half < 2; ++half) {
        const half_cache c = {codes + half * num_slots * num_kv_heads * (int64_t)head_dim,
                              scales + half * num_blocks * num_kv_heads, block_size,
                              num_kv_heads, head_dim, format};
        store_half(&c, half ? v : k, half ? v_stride : k_stride, slots, n, old);
    }
    free(old);
    return 0;
}
