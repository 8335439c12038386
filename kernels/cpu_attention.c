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
 * Work is split by sequence (by sequence and KV head where there are few), and each sequence's
 * blocks are read front to back, once for the keys and once for the values. Scores are kept whole
 * (not an online softmax): a context's scores are small next to its keys, and the two passes then
 * vectorize plainly. GCC's vector extensions (eight floats) carry the head sizes that are
 * multiples of 8; others take a scalar loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t int32x8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline float sum8(vec8 v) {
    float sum = 0.0f;
    for (int lane = 0; lane < 8; ++lane) sum += v[lane];
    return sum;
}

typedef float vec4 __attribute__((vector_size(16)));

/* The sums of four vectors' lanes, as one vector: a tree of shuffles and adds, a few instructions
 * where four lane-by-lane sums take dozens. */
static inline vec4 sum4x8(vec8 a0, vec8 a1, vec8 a2, vec8 a3) {
    const int32x8 even = {0, 8, 1, 9, 4, 12, 5, 13}, odd = {2, 10, 3, 11, 6, 14, 7, 15};
    const vec8 a01 = __builtin_shuffle(a0, a1, even) + __builtin_shuffle(a0, a1, odd);
    const vec8 a23 = __builtin_shuffle(a2, a3, even) + __builtin_shuffle(a2, a3, odd);
    const int32x8 lo = {0, 1, 8, 9, 4, 5, 12, 13}, hi = {2, 3, 10, 11, 6, 7, 14, 15};
    const vec8 halves = __builtin_shuffle(a01, a23, lo) + __builtin_shuffle(a01, a23, hi);
    const vec4 low = {halves[0], halves[1], halves[2], halves[3]};
    const vec4 high = {halves[4], halves[5], halves[6], halves[7]};
    return low + high;
}

/* The scores of `rows` consecutive slots of one block, whose keys start at k: for each head h in
 * h_lo .. h_hi - 1, scores[(h - h_lo) * stride + o] = scale * (q_h . key o of KV head h / group).
 * head_dim is a multiple of 8. A block's keys stay in the L1 cache while every head reads them,
 * and four slots at a time make four independent chains of multiply-adds, which overlap, whose
 * sums are then made together (`sum4x8`). */
static inline __attribute__((always_inline)) void block_scores(
    const float *restrict q, const float *restrict k, int64_t rows, int64_t row, int64_t h_lo,
    int64_t h_hi, int64_t group, int64_t head_dim, float scale, float *restrict scores,
    int64_t stride) {
    for (int64_t h = h_lo; h < h_hi; ++h) {
        const float *qh = q + h * head_dim, *kh = k + (h / group) * head_dim;
        float *s = scores + (h - h_lo) * stride;
        int64_t o = 0;
        for (; o + 4 <= rows; o += 4) {
            vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            const float *k0 = kh + o * row;
            for (int64_t d = 0; d < head_dim; d += 8) {
                const vec8 qd = load8(qh + d);
                a0 += qd * load8(k0 + d);
                a1 += qd * load8(k0 + row + d);
                a2 += qd * load8(k0 + 2 * row + d);
                a3 += qd * load8(k0 + 3 * row + d);
            }
            const vec4 sums = sum4x8(a0, a1, a2, a3) * scale;
            memcpy(s + o, &sums, sizeof sums);
        }
        for (; o < rows; ++o) {
            vec8 acc = {0};
            for (int64_t d = 0; d < head_dim; d += 8) acc += load8(qh + d) * load8(kh + o * row + d);
            s[o] = sum8(acc) * scale;
        }
    }
}

/* Adds the weighted values of `rows` consecutive slots of one block, whose values start at v, to
 * each head's output: out_h += sum over o of weights[(h - h_lo) * stride + o] * value o of KV head
 * h / group. head_dim is a multiple of 8 and at most MAX_DIM. Each head's sum stays in registers
 * across the block, stored once per block rather than once per slot. */
#define MAX_DIM 256
static inline __attribute__((always_inline)) void block_values(
    const float *restrict weights, const float *restrict v, int64_t rows, int64_t row,
    int64_t h_lo, int64_t h_hi, int64_t group, int64_t head_dim, int64_t stride,
    float *restrict out) {
    for (int64_t h = h_lo; h < h_hi; ++h) {
        const float *w = weights + (h - h_lo) * stride, *vh = v + (h / group) * head_dim;
        float *o = out + h * head_dim;
        vec8 acc[MAX_DIM / 8];
        for (int64_t d = 0; d < head_dim; d += 8) acc[d / 8] = load8(o + d);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t d = 0; d < head_dim; d += 8) acc[d / 8] += w[r] * load8(vh + r * row + d);
        for (int64_t d = 0; d < head_dim; d += 8) memcpy(o + d, &acc[d / 8], sizeof(vec8));
    }
}

/* Blocks asked for ahead of their use. The hardware prefetchers follow a stream only within a
 * 4 KiB page, and a sequence's next block is anywhere in the cache: asked for two blocks ahead,
 * decode attention on SmolLM2's shapes (30 layers' caches, 64 sequences) read 12 to 14 GB/s from
 * memory, against 8.5 unasked; one, three or four ahead measured the same within the noise. */
#define AHEAD 2

/* Asks for block j of a sequence's table (every row of it), if it has one. */
static inline void prefetch_block(const float *cache, const int32_t *table, int64_t j,
                                  int64_t last_block, int64_t block_floats) {
    if (j > last_block) return;
    const float *start = cache + (int64_t)table[j] * block_floats;
    for (int64_t i = 0; i < block_floats; i += 16) __builtin_prefetch(start + i, 0, 3);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

/* e^x for x <= 0 (scores less their maximum), eight at a time: x = n ln 2 + r, e^r by Cephes'
 * polynomial (relative error about 1e-7), 2^n put into the exponent bits. Below -87, where 2^n
 * would leave the normal range, the result is e^-87, which rounds to nothing next to the
 * maximum's e^0. */
static inline vec8 exp8_nonpositive(vec8 x) {
    const vec8 lowest = (vec8){0} - 87.0f;
    const int32x8 below = x < lowest; /* all ones where below */
    x = (vec8)(((int32x8)x & ~below) | ((int32x8)lowest & below));
    /* Rounded to the nearest integer by the 1.5 * 2^23 trick, which vectorizes where rintf may
     * not. */
    const vec8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vec8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32x8 bits = (__builtin_convertvector(n, int32x8) + 127) << 23;
    return p * (vec8)bits;
}

/* Turns scores s[0 .. count - 1] into their softmax, in place. */
static void softmax(float *restrict s, int64_t count) {
    float top = -INFINITY;
    for (int64_t i = 0; i < count; ++i) top = s[i] > top ? s[i] : top;
    vec8 totals = {0};
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const vec8 e = exp8_nonpositive(load8(s + i) - top);
        memcpy(s + i, &e, sizeof e);
        totals += e;
    }
    float total = sum8(totals);
    if (i < count) { /* the last few, padded with the maximum's own score */
        float tail[8];
        for (int lane = 0; lane < 8; ++lane) tail[lane] = i + lane < count ? s[i + lane] : top;
        const vec8 e = exp8_nonpositive(load8(tail) - top);
        for (int lane = 0; i + lane < count; ++lane) total += (s[i + lane] = e[lane]);
    }
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < count; ++j) s[j] *= inv;
}

/* Attention of one sequence's query heads of KV heads kv_lo .. kv_hi - 1. `q` and `out` point at
 * the sequence's first head; scores hold (kv_hi - kv_lo) * group rows of the context's length. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const float *restrict key_cache, const float *restrict value_cache,
    const int32_t *restrict table, int64_t first, int64_t len, int64_t kv_lo, int64_t kv_hi,
    int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    float *restrict scores, float *restrict out) {
    const int64_t ctx = len - first;
    const int64_t row = num_kv_heads * head_dim; /* floats between one slot and the next */
    const int64_t first_block = first / block_size, last_block = (len - 1) / block_size;
    const int64_t h_lo = kv_lo * group, h_hi = kv_hi * group;

    /* Slot by slot through each block: a block's rows for all heads lie side by side. */
    for (int64_t j = first_block; j < first_block + AHEAD; ++j)
        prefetch_block(key_cache, table, j, last_block, block_size * row);
    int64_t n = 0;
    for (int64_t j = first_block; j <= last_block; ++j) {
        const int64_t lo = j == first_block ? first % block_size : 0;
        const int64_t hi = j == last_block ? (len - 1) % block_size + 1 : block_size;
        const float *k = key_cache + ((int64_t)table[j] * block_size + lo) * row;
        prefetch_block(key_cache, table, j + AHEAD, last_block, block_size * row);
        if (head_dim % 8 == 0) {
            block_scores(q, k, hi - lo, row, h_lo, h_hi, group, head_dim, scale, scores + n, ctx);
            n += hi - lo;
            continue;
        }
        for (int64_t o = lo; o < hi; ++o, ++n, k += row)
            for (int64_t h = h_lo; h < h_hi; ++h)
                scores[(h - h_lo) * ctx + n] =
                    dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
    }

    for (int64_t j = first_block; j < first_block + AHEAD; ++j)
        prefetch_block(value_cache, table, j, last_block, block_size * row);
    for (int64_t h = h_lo; h < h_hi; ++h) {
        softmax(scores + (h - h_lo) * ctx, ctx);
        float *o = out + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    }

    n = 0;
    for (int64_t j = first_block; j <= last_block; ++j) {
        const int64_t lo = j == first_block ? first % block_size : 0;
        const int64_t hi = j == last_block ? (len - 1) % block_size + 1 : block_size;
        const float *v = value_cache + ((int64_t)table[j] * block_size + lo) * row;
        prefetch_block(value_cache, table, j + AHEAD, last_block, block_size * row);
        if (head_dim % 8 == 0 && head_dim <= MAX_DIM) {
            block_values(scores + n, v, hi - lo, row, h_lo, h_hi, group, head_dim, ctx, out);
            n += hi - lo;
            continue;
        }
        for (int64_t o = lo; o < hi; ++o, ++n, v += row)
            for (int64_t h = h_lo; h < h_hi; ++h) {
                const float w = scores[(h - h_lo) * ctx + n];
                const float *restrict vh = v + (h / group) * head_dim;
                float *restrict acc = out + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * vh[d];
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
    /* A whole sequence per work item reads its blocks front to back; with too few sequences to
     * keep every thread busy, each KV head is an item of its own. */
    const int64_t split = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t heads_per_item = num_kv_heads / split;
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_lens[i] - first_keys[i] > longest) longest = seq_lens[i] - first_keys[i];
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * heads_per_item * group * longest);
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * split; ++item) {
            if (scores == NULL) continue;
            const int64_t i = item / split, kv_lo = (item % split) * heads_per_item;
            const int64_t offset = token_rows[i] * num_heads * head_dim;
            const int32_t *table = block_tables + table_rows[i] * table_width;
            /* The common head sizes as constants: their loops unroll and keep to registers. */
#define ATTEND(dim)                                                                          \
    attend(query + offset, key_cache, value_cache, table, first_keys[i], seq_lens[i], kv_lo, \
           kv_lo + heads_per_item, group, num_kv_heads, dim, block_size, scale, scores,     \
           out + offset)
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
