/* Paged decode attention on the CPU, float32: each sequence has one query token, and its keys and
 * values are read in place from their cache blocks, never gathered into a copy.
 *
 * Layouts (all contiguous, row-major):
 *   query, out       [num_tokens, num_heads, head_dim]
 *   key/value cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_tables, table_width] int32
 * Sequence i's query is row token_rows[i]; it attends positions first_keys[i] .. seq_lens[i] - 1,
 * whose slots are found through block table row table_rows[i].
 *
 * Work is split over (sequence, KV head) pairs: the query heads sharing a KV head read each key and
 * value row once between them. Scores are kept whole (not an online softmax): a context's scores
 * are small next to its keys, and two plain passes vectorize better.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

/* e^x for x <= 0 (scores less their maximum), vectorizable where expf is not: x = n ln 2 + r,
 * e^r by Cephes' polynomial (relative error about 1e-7), 2^n put into the exponent bits. Below
 * -87, where 2^n would leave the normal range, the result is e^-87, which rounds to nothing next
 * to the maximum's e^0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

static inline __attribute__((always_inline)) void attend_one(const float *restrict q, const float *restrict key_cache,
                       const float *restrict value_cache, const int32_t *restrict table,
                       int64_t first, int64_t len, int64_t kv_head, int64_t group,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       float *restrict scores, float *restrict out) {
    const int64_t ctx = len - first;
    const int64_t row = num_kv_heads * head_dim; /* floats between one slot and the next */
    const int64_t first_block = first / block_size, last_block = (len - 1) / block_size;

    int64_t n = 0;
    for (int64_t j = first_block; j <= last_block; ++j) {
        const int64_t lo = j == first_block ? first % block_size : 0;
        const int64_t hi = j == last_block ? (len - 1) % block_size + 1 : block_size;
        const float *k = key_cache + ((int64_t)table[j] * block_size + lo) * row + kv_head * head_dim;
        for (int64_t o = lo; o < hi; ++o, ++n, k += row)
            for (int64_t g = 0; g < group; ++g)
                scores[g * ctx + n] = dot(q + g * head_dim, k, head_dim) * scale;
    }

    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * ctx;
        float top = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < ctx; ++i) top = s[i] > top ? s[i] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < ctx; ++i) total += (s[i] = exp_nonpositive(s[i] - top));
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t i = 0; i < ctx; ++i) s[i] *= inv;
        float *o = out + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    }

    n = 0;
    for (int64_t j = first_block; j <= last_block; ++j) {
        const int64_t lo = j == first_block ? first % block_size : 0;
        const int64_t hi = j == last_block ? (len - 1) % block_size + 1 : block_size;
        const float *v =
            value_cache + ((int64_t)table[j] * block_size + lo) * row + kv_head * head_dim;
        for (int64_t o = lo; o < hi; ++o, ++n, v += row)
            for (int64_t g = 0; g < group; ++g) {
                const float w = scores[g * ctx + n];
                float *restrict acc = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * v[d];
            }
    }
}

/* Returns 0, or -1 when a thread could not allocate its score buffer (nothing is written then by
 * that thread; the caller treats the whole call as failed). */
int paged_decode_attention(const float *query, const float *key_cache, const float *value_cache,
                           const int32_t *block_tables, int64_t table_width,
                           const int64_t *token_rows, const int64_t *table_rows,
                           const int64_t *first_keys, const int64_t *seq_lens, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int num_threads, float *out) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_lens[i] - first_keys[i] > longest) longest = seq_lens[i] - first_keys[i];
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * longest);
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
            if (scores == NULL) continue;
            const int64_t i = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t head_offset = (token_rows[i] * num_heads + kv_head * group) * head_dim;
            const float *q = query + head_offset;
            const int32_t *table = block_tables + table_rows[i] * table_width;
            float *o = out + head_offset;
            /* The common head sizes as constants: their loops unroll and keep to registers. */
#define ATTEND(dim)                                                                         \
    attend_one(q, key_cache, value_cache, table, first_keys[i], seq_lens[i], kv_head, group, \
               num_kv_heads, dim, block_size, scale, scores, o)
            if (head_dim == 64)
                ATTEND(64);
            else if (head_dim == 128)
                ATTEND(128);
            else
                ATTEND(head_dim);
#undef ATTEND
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
