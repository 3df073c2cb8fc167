/* Paged decode attention on CPU, fp32: one query token per sequence, read straight from the
 * paged KV cache. The PyTorch path has to gather each sequence's blocks into a contiguous
 * copy before attention (write the copy, read it again); this reads every K/V row once.
 *
 * Work item = (sequence, KV head): the group of query heads sharing that KV head is processed
 * together, so each K/V row is loaded once for the whole group. Per block: scores for the
 * block's tokens, one rescale of the running sum and accumulator (online softmax), then the
 * weighted V rows. Items are spread over OpenMP threads.
 *
 * Layout (architecture.md): kv = [2, num_blocks, block_size, num_kv_heads, head_dim].
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

#ifdef _OPENMP
#include <omp.h>
void kp_set_threads(int n) { if (n > 0) omp_set_num_threads(n); }
#else
void kp_set_threads(int n) { (void)n; }
#endif

int kp_paged_decode_f32(const float *q, int64_t q_row_stride, const float *kv,
                        int64_t num_blocks, int32_t block_size, int32_t num_kv_heads,
                        int32_t head_dim, int32_t num_heads, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *seq_lens, const int64_t *tok_idx,
                        const int64_t *seq_idx, int64_t n, float scale, float *out,
                        int64_t out_row_stride) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads)
        return -1;
    const int64_t tok_stride = (int64_t)num_kv_heads * head_dim;
    const float *k_base = kv;
    const float *v_base = kv + num_blocks * (int64_t)block_size * tok_stride;
    const int64_t items = n * num_kv_heads;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t row = item / num_kv_heads;
        const int kvh = (int)(item % num_kv_heads);
        const int64_t tok = tok_idx[row];
        const int64_t seq = seq_idx[row];
        const int32_t len = seq_lens[seq];
        const int32_t *table = block_tables + seq * bt_stride;

        float qs[MAX_GROUP * MAX_HEAD_DIM];
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        float scores[MAX_GROUP * MAX_BLOCK];
        float m[MAX_GROUP], l[MAX_GROUP];
        for (int g = 0; g < group; ++g) {
            const float *qh = q + tok * q_row_stride + (int64_t)(kvh * group + g) * head_dim;
            for (int d = 0; d < head_dim; ++d) {
                qs[g * head_dim + d] = qh[d] * scale;
                acc[g * head_dim + d] = 0.0f;
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        const int32_t nblk = (len + block_size - 1) / block_size;
        for (int32_t b = 0; b < nblk; ++b) {
            const int64_t blk = table[b];
            const int32_t cnt = (len - b * block_size) < block_size ? (len - b * block_size)
                                                                    : block_size;
            const float *kb = k_base + blk * block_size * tok_stride + (int64_t)kvh * head_dim;
            const float *vb = v_base + blk * block_size * tok_stride + (int64_t)kvh * head_dim;
            for (int g = 0; g < group; ++g) {
                const float *qg = qs + g * head_dim;
                float *sg = scores + g * MAX_BLOCK;
                float mx = m[g];
                for (int32_t t = 0; t < cnt; ++t) {
                    const float *kt = kb + t * tok_stride;
                    float s = 0.0f;
                    for (int d = 0; d < head_dim; ++d) s += qg[d] * kt[d];
                    sg[t] = s;
                    if (s > mx) mx = s;
                }
                const float corr = (m[g] == -INFINITY) ? 0.0f : expf(m[g] - mx);
                float *ag = acc + g * head_dim;
                if (corr != 1.0f) {
                    l[g] *= corr;
                    for (int d = 0; d < head_dim; ++d) ag[d] *= corr;
                }
                m[g] = mx;
                float sum = 0.0f;
                for (int32_t t = 0; t < cnt; ++t) {
                    const float p = expf(sg[t] - mx);
                    sum += p;
                    const float *vt = vb + t * tok_stride;
                    for (int d = 0; d < head_dim; ++d) ag[d] += p * vt[d];
                }
                l[g] += sum;
            }
        }
        for (int g = 0; g < group; ++g) {
            float *o = out + tok * out_row_stride + (int64_t)(kvh * group + g) * head_dim;
            const float inv = 1.0f / l[g];
            for (int d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
        }
    }
    return 0;
}
