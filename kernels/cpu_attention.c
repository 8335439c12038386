/* Paged decode attention on the CPU, float32 queries: each sequence has one query token, and its
 * keys and values are read in place from their cache blocks, never gathered into a copy.
 *
 * Layouts (all contiguous, row-major):
 *   query, out       [num_tokens, num_heads, head_dim]
 *   key/value cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_tables, table_width] int32
 * Sequence i's query is row token_rows[i]; it attends positions first_keys[i] .. seq_lens[i] - 1,
 * whose slots are found through block table row table_rows[i].
 *
 * Work is split by sequence (by sequence and KV head where there are few), and each sequence's
 * blocks are read front to back, once for the keys and once for the values, in chunks of up to
 * one vector's width of slots:
 * - keys: each query head's dot products with the chunk's W keys are W vectors of partial sums,
 *   folded into one vector of W scores by `sum_lanes` (2(W - 1) shuffles rather than W
 *   horizontal sums); the chunk's keys stay in the L1 cache while the KV head's query heads read
 *   them. Each head's running maximum is kept as the scores are made.
 * - softmax: one pass, e^(s - max) and its total; the division by the total is left to the end,
 *   on the head's output.
 * - values: each head's output stays in registers across a chunk.
 * Scores are kept whole (not an online softmax): a context's scores are small next to its keys.
 * Vectors are GCC vector extensions of W floats, one AVX-512 register where the CPU has it (the
 * library is built with -march=native), else eight; heads (or a quantized cache's scale groups)
 * that are no multiple of W take a scalar loop.
 *
 * The cache may be float32 or quantized (kv_quant.py): int8 or float8 e4m3 elements, each group
 * of `scale_group` elements of a (slot, KV head) row with a float32 scale in
 * `key_scales`/`value_scales` [num_blocks, block_size, num_kv_heads, head_dim / scale_group].
 * Elements are widened to floats as they are loaded (a byte's W lanes at a time); a key group's
 * scale multiplies that group's partial dot product with the query, and a value group's scale
 * the softmax weight its elements are added with, so dequantizing costs one multiply a group,
 * not one an element. A bfloat16 or float16 cache (a model's dtype, or a float32 model's
 * kv_cache_dtype) has no scales: its elements are widened exactly, a bfloat16's 16 bits the top
 * half of a float's, a float16's by F16C's vcvtph2ps. Queries and outputs stay float32 in every
 * format (attention.py converts a bfloat16 query's at the call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_attention.h"

#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
#define MAX_DIM 256 /* the largest head size the vector path keeps in registers */

typedef float vec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint16_t u16vec __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t u32vec __attribute__((vector_size(W * sizeof(uint32_t))));

static inline int64_t element_size(enum kv_format fmt) {
    return fmt == KV_FLOAT32 ? 4 : fmt == KV_BF16 || fmt == KV_F16 ? 2 : 1;
}

/* Whether the format's rows carry a scale each (int8, float8). */
static inline int scaled(enum kv_format fmt) { return fmt == KV_INT8 || fmt == KV_FP8; }

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec splat(float x) { return (vec){0} + x; }

static inline ivec lane_index(void) {
    ivec idx;
    for (int i = 0; i < W; ++i) idx[i] = i;
    return idx;
}

static inline vec vmax(vec a, vec b) {
    const ivec greater = a > b;
    return (vec)(((ivec)a & greater) | ((ivec)b & ~greater));
}

/* W bytes from p widened to 32-bit lanes, sign-extended (int8) or not (uint8). One instruction
 * with AVX-512 or AVX2 (vpmovsxbd / vpmovzxbd): GCC's __builtin_convertvector from a byte vector
 * inserts the lanes one at a time, which made an int8 cache 4x slower to read than float32's. */
static inline ivec widen_bytes(const uint8_t *p, int is_signed) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (ivec)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (ivec)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    ivec x;
    for (int i = 0; i < W; ++i) x[i] = is_signed ? (int32_t)(int8_t)p[i] : (int32_t)p[i];
    return x;
#endif
}

/* W float8 e4m3 (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities) as floats:
 * (8 + m) * 2^(e - 10), or m * 2^-9 for e = 0 (the subnormals), built from integers so that no
 * float subnormal (slow on some CPUs) appears on the way. Exact: every e4m3 value is a float. */
static inline vec fp8_to_float(const uint8_t *p) {
    const ivec x = widen_bytes(p, 0);
    const ivec e = (x >> 3) & 15, normal = e != 0; /* all ones where e > 0 */
    const vec mantissa = __builtin_convertvector((x & 7) | (normal & 8), vec);
    const ivec power = ((e | (~normal & 1)) + 117) << 23; /* 2^(max(e, 1) - 10) */
    return (vec)((ivec)(mantissa * (vec)power) | ((x & 0x80) << 24));
}

/* W float16 as floats (exact). */
static inline vec f16_to_float(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vec x;
    for (int i = 0; i < W; ++i) x[i] = (float)((const _Float16 *)p)[i];
    return x;
#endif
}

static inline float fp8_scalar(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float magnitude = e ? ldexpf((float)(m | 8), e - 10) : ldexpf((float)m, -9);
    return b & 0x80 ? -magnitude : magnitude;
}

/* W elements of the cache from p (unscaled) as floats. */
static inline __attribute__((always_inline)) vec load_kv(const uint8_t *p, enum kv_format fmt) {
    if (fmt == KV_FLOAT32) return load((const float *)p);
    if (fmt == KV_INT8) return __builtin_convertvector(widen_bytes(p, 1), vec);
    if (fmt == KV_BF16) {
        u16vec h;
        memcpy(&h, p, sizeof h);
        return (vec)(__builtin_convertvector(h, u32vec) << 16);
    }
    if (fmt == KV_F16) return f16_to_float(p);
    return fp8_to_float(p);
}

/* Element i of the cache row at p (unscaled). */
static inline __attribute__((always_inline)) float kv_element(const uint8_t *p, int64_t i,
                                                             enum kv_format fmt) {
    if (fmt == KV_FLOAT32) return ((const float *)p)[i];
    if (fmt == KV_INT8) return (float)((const int8_t *)p)[i];
    if (fmt == KV_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float x;
        memcpy(&x, &bits, sizeof x);
        return x;
    }
    if (fmt == KV_F16) return (float)((const _Float16 *)p)[i];
    return fp8_scalar(p[i]);
}

/* Lane i of the result is the sum of a[i]'s lanes: a transpose of W vectors folded into one. Each
 * round pairs the vectors and halves what each lane stands for: after the round of step s, lane
 * i holds a partial sum of vector (i mod 2s) of its group. a is overwritten. */
static inline __attribute__((always_inline)) vec sum_lanes(vec a[W]) {
    const ivec idx = lane_index();
#pragma GCC unroll 8
    for (int s = 1, n = W; s < W; s <<= 1, n >>= 1) {
        const ivec upper = (idx & s) != 0; /* all ones in the lanes taken from the pair's second */
        const ivec lo = idx + (upper & (W - s)), hi = lo + s;
#pragma GCC unroll 16
        for (int p = 0; p < n / 2; ++p)
            a[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], lo) +
                   __builtin_shuffle(a[2 * p], a[2 * p + 1], hi);
    }
    return a[0];
}

/* Blocks asked for ahead of their use, a chunk's rows at a time as the same chunk of the block
 * AHEAD places on is read. The hardware prefetchers follow a stream only within a 4 KiB page,
 * and a sequence's next block is anywhere in the cache. */
#define AHEAD 2

static inline void prefetch_rows(const uint8_t *cache, const int32_t *table, int64_t j,
                                 int64_t last_block, int64_t block_size, int64_t row_bytes,
                                 int64_t lo, int64_t hi, int64_t span_lo, int64_t span) {
    if (j > last_block) return;
    const uint8_t *base = cache + (int64_t)table[j] * block_size * row_bytes + span_lo;
    for (int64_t r = lo; r < hi && r < block_size; ++r)
        for (int64_t i = 0; i < span; i += 64) __builtin_prefetch(base + r * row_bytes + i, 0, 1);
}

/* One work item: a sequence's query heads of KV heads kv_lo .. kv_hi - 1 and where it reads and
 * writes. Head h_lo + i's scores are scores[i * ctx ..], its output out + (h_lo + i) * head_dim. */
struct item {
    const float *q; /* the sequence's query, head 0 */
    float *out, *scores;
    const int32_t *table;
    int64_t first, len, ctx, kv_lo, kv_hi, h_lo, heads, group, row, head_dim, block_size;
    /* A quantized cache's: elements a scale covers (the whole head for a float cache, which has
     * none), and the scales a slot holds over its KV heads. */
    int64_t scale_group, slot_scales;
    float scale;
    vec *top; /* each head's running maximum of its scores, lane-wise */
};

static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const uint8_t *restrict b, int64_t n,
                                                       enum kv_format fmt) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * kv_element(b, d, fmt);
    return acc;
}

/* Whether the item's rows suit the vector paths: whole vectors of W in each scale's group, and a
 * head the registers hold. */
static inline int vectorized(const struct item *it) {
    return it->scale_group % W == 0 && it->head_dim <= MAX_DIM;
}

/* The scales of KV head g's row in the o-th slot from ks (a quantized cache's). */
static inline const float *row_scales(const struct item *it, const float *ks, int64_t o,
                                      int64_t g) {
    return ks + o * it->slot_scales + g * (it->head_dim / it->scale_group);
}

/* The scores of `rows` (1 to W) consecutive slots whose keys start at k (their scales at ks,
 * a quantized cache's), the n-th of the context onwards, for each of the item's heads; each
 * head's maximum takes them in. */
static inline __attribute__((always_inline)) void chunk_scores(const struct item *it,
                                                              const uint8_t *restrict k,
                                                              const float *restrict ks,
                                                              int64_t rows, int64_t n,
                                                              enum kv_format fmt) {
    const int64_t head_dim = it->head_dim, row = it->row, es = element_size(fmt);
    const int64_t sg = it->scale_group;
    /* Lanes past `rows` are no slots: -inf, so that they count for nothing in the maximum. */
    const ivec past = lane_index() >= (int32_t)rows;
    const vec nothing = splat(-INFINITY);
    for (int64_t g = it->kv_lo, i = 0; g < it->kv_hi; ++g) {
        const uint8_t *kg = k + g * head_dim * es;
        for (int64_t h = g * it->group; h < (g + 1) * it->group; ++h, ++i) {
            float *sh = it->scores + i * it->ctx + n;
            const float *qh0 = it->q + h * head_dim;
            if (!vectorized(it)) {
                for (int64_t r = 0; r < rows; ++r) {
                    const uint8_t *kr = kg + r * row * es;
                    float s = 0.0f;
                    for (int64_t d = 0; d < head_dim; d += sg) {
                        const float part = dot(qh0 + d, kr + d * es, sg, fmt);
                        s += scaled(fmt) ? part * row_scales(it, ks, r, g)[d / sg] : part;
                    }
                    sh[r] = it->scale * s;
                    /* one lane of the running maximum serves: the others stay -inf */
                    it->top[i][0] = sh[r] > it->top[i][0] ? sh[r] : it->top[i][0];
                }
                continue;
            }
            vec qh[MAX_DIM / W];
            for (int64_t d = 0; d < head_dim; d += W) qh[d / W] = load(qh0 + d);
            vec acc[W];
#pragma GCC unroll 16
            for (int o = 0; o < W; ++o) {
                vec a = {0};
                if (o < rows)
                    /* Group by group: each group's partial dot product times its scale. */
                    for (int64_t d = 0; d < head_dim; d += sg) {
                        vec part = {0};
                        for (int64_t e = d; e < d + sg; e += W)
                            part += qh[e / W] * load_kv(kg + (o * row + e) * es, fmt);
                        a += scaled(fmt) ? part * splat(row_scales(it, ks, o, g)[d / sg]) : part;
                    }
                acc[o] = a;
            }
            vec sc = sum_lanes(acc) * splat(it->scale);
            if (rows == W) {
                store(sh, sc);
            } else {
                memcpy(sh, &sc, rows * sizeof(float));
                sc = (vec)(((ivec)sc & ~past) | ((ivec)nothing & past));
            }
            it->top[i] = vmax(it->top[i], sc);
        }
    }
}

/* Adds the values of `rows` consecutive slots whose values start at v (their scales at vs, a
 * quantized cache's), the n-th of the context onwards, to each of the item's heads' outputs,
 * weighted by the head's scores (by then exponentiated):
 * out_h += sum over o of w_h[n + o] * value o of KV head h / group. */
static inline __attribute__((always_inline)) void chunk_values(const struct item *it,
                                                              const uint8_t *restrict v,
                                                              const float *restrict vs,
                                                              int64_t rows, int64_t n,
                                                              enum kv_format fmt) {
    const int64_t head_dim = it->head_dim, row = it->row, es = element_size(fmt);
    const int64_t sg = it->scale_group;
    for (int64_t g = it->kv_lo, i = 0; g < it->kv_hi; ++g) {
        const uint8_t *vg = v + g * head_dim * es;
        for (int64_t h = g * it->group; h < (g + 1) * it->group; ++h, ++i) {
            const float *w = it->scores + i * it->ctx + n;
            float *o = it->out + h * head_dim;
            if (!vectorized(it)) {
                for (int64_t r = 0; r < rows; ++r) {
                    const uint8_t *vr = vg + r * row * es;
                    for (int64_t d0 = 0; d0 < head_dim; d0 += sg) {
                        const float weight =
                            scaled(fmt) ? w[r] * row_scales(it, vs, r, g)[d0 / sg] : w[r];
#pragma omp simd
                        for (int64_t d = d0; d < d0 + sg; ++d)
                            o[d] += weight * kv_element(vr, d, fmt);
                    }
                }
                continue;
            }
            vec acc[MAX_DIM / W];
            for (int64_t d = 0; d < head_dim; d += W) acc[d / W] = load(o + d);
            for (int64_t r = 0; r < rows; ++r) {
                /* Group by group: the weight times the group's scale. */
                for (int64_t d = 0; d < head_dim; d += sg) {
                    const vec weight =
                        splat(scaled(fmt) ? w[r] * row_scales(it, vs, r, g)[d / sg] : w[r]);
                    for (int64_t e = d; e < d + sg; e += W)
                        acc[e / W] += weight * load_kv(vg + (r * row + e) * es, fmt);
                }
            }
            for (int64_t d = 0; d < head_dim; d += W) store(o + d, acc[d / W]);
        }
    }
}

/* One pass over the item's context in its blocks, a chunk of up to W slots at a time (a block of
 * fewer slots is a chunk of its own): the keys' scores, or the weighted values. */
enum pass { KEYS, VALUES };

static inline __attribute__((always_inline)) void walk(const struct item *it, enum pass pass,
                                                      const uint8_t *restrict cache,
                                                      const float *restrict scales,
                                                      enum kv_format fmt) {
    const int64_t first_block = it->first / it->block_size;
    const int64_t last_block = (it->len - 1) / it->block_size;
    const int64_t es = element_size(fmt), row_bytes = it->row * es;
    const int64_t span_lo = it->kv_lo * it->head_dim * es;
    const int64_t span = (it->kv_hi - it->kv_lo) * it->head_dim * es;
    const int64_t block_size = it->block_size, slot_scales = it->slot_scales;
    /* A quantized cache's scales, a slot's slot_scales floats, are asked for ahead as its rows. */
    const int64_t scale_row = slot_scales * (int64_t)sizeof(float);
    const uint8_t *scale_bytes = (const uint8_t *)scales;
    for (int64_t j = first_block; j < first_block + AHEAD; ++j) {
        prefetch_rows(cache, it->table, j, last_block, block_size, row_bytes, 0, block_size,
                      span_lo, span);
        if (scaled(fmt))
            prefetch_rows(scale_bytes, it->table, j, last_block, block_size, scale_row, 0,
                          block_size, 0, scale_row);
    }
    for (int64_t j = first_block, n = 0; j <= last_block; ++j) {
        const int64_t lo = j == first_block ? it->first % block_size : 0;
        const int64_t hi = j == last_block ? (it->len - 1) % block_size + 1 : block_size;
        const uint8_t *block = cache + (int64_t)it->table[j] * block_size * row_bytes;
        const float *block_scales =
            scaled(fmt) ? scales + (int64_t)it->table[j] * block_size * slot_scales : NULL;
        for (int64_t o = lo, rows; o < hi; o += rows, n += rows) {
            rows = hi - o < W ? hi - o : W;
            prefetch_rows(cache, it->table, j + AHEAD, last_block, block_size, row_bytes, o, o + W,
                          span_lo, span);
            if (scaled(fmt) && o % (64 / sizeof(float)) == 0)
                prefetch_rows(scale_bytes, it->table, j + AHEAD, last_block, block_size,
                              scale_row, o, o + W, 0, scale_row);
            const float *chunk_scales = block_scales ? block_scales + o * slot_scales : NULL;
            if (pass == KEYS)
                chunk_scores(it, block + o * row_bytes, chunk_scales, rows, n, fmt);
            else
                chunk_values(it, block + o * row_bytes, chunk_scales, rows, n, fmt);
        }
    }
}

/* e^x for x <= 0 (scores less their maximum), W at a time: x = n ln 2 + r, e^r by Cephes'
 * polynomial (relative error about 1e-7), 2^n put into the exponent bits. Below -87, where 2^n
 * would leave the normal range, the result is e^-87, which rounds to nothing next to the
 * maximum's e^0. */
static inline vec exp_nonpositive(vec x) {
    x = vmax(x, splat(-87.0f));
    /* Rounded to the nearest integer by the 1.5 * 2^23 trick, which vectorizes where rintf may
     * not. */
    const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return p * (vec)bits;
}

/* s[0 .. count - 1] = e^(s - top), in place; returns their sum. */
static float exponentiate(float *restrict s, int64_t count, float top) {
    vec totals = {0};
    int64_t i = 0;
    for (; i + W <= count; i += W) {
        const vec e = exp_nonpositive(load(s + i) - top);
        store(s + i, e);
        totals += e;
    }
    float total = 0.0f;
    for (int lane = 0; lane < W; ++lane) total += totals[lane];
    if (i < count) { /* the last few, padded with the maximum's own score */
        float tail[W];
        for (int lane = 0; lane < W; ++lane) tail[lane] = i + lane < count ? s[i + lane] : top;
        const vec e = exp_nonpositive(load(tail) - top);
        for (int lane = 0; i + lane < count; ++lane) total += (s[i + lane] = e[lane]);
    }
    return total;
}

/* Attention of one work item (see `struct item`). */
static inline __attribute__((always_inline)) void attend(struct item *it,
                                                        const uint8_t *restrict key_cache,
                                                        const uint8_t *restrict value_cache,
                                                        const float *restrict key_scales,
                                                        const float *restrict value_scales,
                                                        enum kv_format fmt) {
    vec top[it->heads];
    for (int64_t i = 0; i < it->heads; ++i) top[i] = splat(-INFINITY);
    it->top = top;
    walk(it, KEYS, key_cache, key_scales, fmt);

    float inv[it->heads];
    for (int64_t i = 0; i < it->heads; ++i) {
        float most = -INFINITY;
        for (int lane = 0; lane < W; ++lane) most = top[i][lane] > most ? top[i][lane] : most;
        inv[i] = 1.0f / exponentiate(it->scores + i * it->ctx, it->ctx, most);
        float *o = it->out + (it->h_lo + i) * it->head_dim;
        for (int64_t d = 0; d < it->head_dim; ++d) o[d] = 0.0f;
    }
    walk(it, VALUES, value_cache, value_scales, fmt);
    for (int64_t i = 0; i < it->heads; ++i) {
        float *o = it->out + (it->h_lo + i) * it->head_dim;
        for (int64_t d = 0; d < it->head_dim; ++d) o[d] *= inv[i];
    }
}

/* `attend` with the common shapes as constants, so that their loops unroll and keep to
 * registers: heads of 64, 128 and 256 (Gemma 3's), whole (a float cache's) or in groups of 32 (a
 * quantized cache's, kv_quant.GROUP). Another head size keeps its outputs' vectors in memory, a
 * store and a load each multiply-add: Gemma 3's heads of 256 took 1.2-1.3x as long so. */
static inline __attribute__((always_inline)) void attend_shaped(struct item *it,
                                                               const uint8_t *key_cache,
                                                               const uint8_t *value_cache,
                                                               const float *key_scales,
                                                               const float *value_scales,
                                                               enum kv_format fmt) {
    if (it->head_dim == 64 && it->scale_group == (scaled(fmt) ? 32 : 64)) {
        it->head_dim = 64;
        it->scale_group = scaled(fmt) ? 32 : 64;
        attend(it, key_cache, value_cache, key_scales, value_scales, fmt);
    } else if (it->head_dim == 128 && it->scale_group == (scaled(fmt) ? 32 : 128)) {
        it->head_dim = 128;
        it->scale_group = scaled(fmt) ? 32 : 128;
        attend(it, key_cache, value_cache, key_scales, value_scales, fmt);
    } else if (it->head_dim == 256 && it->scale_group == (scaled(fmt) ? 32 : 256)) {
        it->head_dim = 256;
        it->scale_group = scaled(fmt) ? 32 : 256;
        attend(it, key_cache, value_cache, key_scales, value_scales, fmt);
    } else {
        attend(it, key_cache, value_cache, key_scales, value_scales, fmt);
    }
}

/* `attend_shaped` with the format as a constant, so that each format's loops are compiled for
 * it. */
static inline __attribute__((always_inline)) void attend_format(struct item *it,
                                                               const uint8_t *key_cache,
                                                               const uint8_t *value_cache,
                                                               const float *key_scales,
                                                               const float *value_scales,
                                                               enum kv_format fmt) {
    if (fmt == KV_INT8)
        attend_shaped(it, key_cache, value_cache, key_scales, value_scales, KV_INT8);
    else if (fmt == KV_FP8)
        attend_shaped(it, key_cache, value_cache, key_scales, value_scales, KV_FP8);
    else if (fmt == KV_BF16)
        attend_shaped(it, key_cache, value_cache, key_scales, value_scales, KV_BF16);
    else if (fmt == KV_F16)
        attend_shaped(it, key_cache, value_cache, key_scales, value_scales, KV_F16);
    else
        attend_shaped(it, key_cache, value_cache, key_scales, value_scales, KV_FLOAT32);
}

/* Returns 0, or -1 when a thread could not allocate its score buffer (nothing is written then by
 * that thread; the caller treats the whole call as failed), -2 for a format it does not know or
 * a quantized cache's scale_group that is no divisor of head_dim. key_scales, value_scales and
 * scale_group are a quantized cache's (NULL, NULL and any for the float formats). */
int paged_decode_attention_kv(const float *query, const void *key_cache, const void *value_cache,
                              const float *key_scales, const float *value_scales, int format,
                              int64_t scale_group, const int32_t *block_tables, int64_t table_width,
                              const int64_t *token_rows, const int64_t *table_rows,
                              const int64_t *first_keys, const int64_t *seq_lens,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, float scale, int num_threads,
                              float *out) {
    if (format < KV_FLOAT32 || format > KV_F16) return -2;
    const enum kv_format fmt = (enum kv_format)format;
    if (!scaled(fmt)) scale_group = head_dim; /* no scales: the whole row is one group */
    if (scale_group <= 0 || head_dim % scale_group != 0) return -2;
    const uint8_t *keys = key_cache, *values = value_cache;
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
            struct item it = {
                .q = query + offset,
                .out = out + offset,
                .scores = scores,
                .table = block_tables + table_rows[i] * table_width,
                .first = first_keys[i],
                .len = seq_lens[i],
                .ctx = seq_lens[i] - first_keys[i],
                .kv_lo = kv_lo,
                .kv_hi = kv_lo + heads_per_item,
                .h_lo = kv_lo * group,
                .heads = heads_per_item * group,
                .group = group,
                .row = num_kv_heads * head_dim,
                .head_dim = head_dim,
                .block_size = block_size,
                .scale_group = scale_group,
                .slot_scales = num_kv_heads * (head_dim / scale_group),
                .scale = scale,
            };
            attend_format(&it, keys, values, key_scales, value_scales, fmt);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
