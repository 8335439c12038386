/* Rotary position embedding (neox style, rotate_half) on the CPU, float32, queries and keys in
 * one pass.
 *
 * Layouts: query [num_tokens, q_heads, head_dim] and key [num_tokens, k_heads, head_dim] with
 * their heads contiguous and tokens `q_stride` / `k_stride` floats apart (views of one fused QKV
 * projection); the outputs are contiguous. cos_sin [rows, head_dim] holds head_dim / 2 cosines
 * then head_dim / 2 sines; token t uses row positions[t].
 *
 * Bitwise equal to transformers' q * cos + rotate_half(q) * sin: each product is rounded before
 * the sum, as torch computes it, so this file's functions must never fuse a multiply with an add
 * (the library is built with -ffp-contract=fast for the attention kernel).
 */
#include <stdint.h>

__attribute__((optimize("fp-contract=off"))) static void rotate_heads(
    const float *restrict x, int64_t heads, int64_t half, const float *restrict cos,
    const float *restrict sin, float *restrict out) {
    for (int64_t h = 0; h < heads; ++h, x += 2 * half, out += 2 * half)
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[half + i];
            out[i] = x1 * cos[i] - x2 * sin[i];
            out[half + i] = x2 * cos[i] + x1 * sin[i];
        }
}

/* Returns 0, or -1 (having written nothing) when a position has no row in the table. */
int rotary_embedding(const int64_t *positions, int64_t num_tokens, const float *query,
                     int64_t q_stride, int64_t q_heads, const float *key, int64_t k_stride,
                     int64_t k_heads, int64_t head_dim, const float *cos_sin, int64_t rows,
                     int num_threads, float *q_out, float *k_out) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= rows) return -1;
    const int64_t half = head_dim / 2;
    /* A decode step's few tokens are done sooner by one thread than by waking the others. */
    const int parallel = num_tokens * (q_heads + k_heads) * head_dim >= (1 << 16);
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_sin + positions[t] * head_dim, *sin = cos + half;
        rotate_heads(query + t * q_stride, q_heads, half, cos, sin, q_out + t * q_heads * head_dim);
        rotate_heads(key + t * k_stride, k_heads, half, cos, sin, k_out + t * k_heads * head_dim);
    }
    return 0;
}
