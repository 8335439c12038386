/* Matrix products with GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K;
 * layouts in quant_blocks.py), float32 activations and outputs.
 *
 * quant_matmul_float, quant_matmul_int16 and quant_matmul_int8: out[n, rows] = x[n, cols] @
 * dequantized(w).T for a few rows of x (a decode step's sequences). The weights are read once a
 * call, row by row, each row against every row of x while it sits in L1: a call is bound by the
 * weights' bytes, a quarter (Q4) or half (Q8) of float16's, where its arithmetic keeps up. The
 * three differ in the activations:
 * - float: each block's weights are expanded to floats in registers and multiplied with x as it
 *   is: exact mode's arithmetic, in another order.
 * - int16: each row of x quantized per block of 32 to int16 (within 2^-16 of the block's
 *   largest), the weights widened to int16, their products summed exactly in int32 (vpmaddwd)
 *   and scaled once a block. Greedy answers follow exact mode's as the float path's do (SmolLM2
 *   and Gemma 3, 32 chats each: every answer identical over 32 tokens), at int8's speed: the
 *   default with AVX2.
 * - int8 (llama.cpp's vec_dot_q4_1_q8_1 and kin): each row of x is first quantized per block of
 *   32 to int8 with one float scale (a = xd * xq, |xq| <= 127, error at most xd / 2 a value), so
 *   that a block's dot product is one integer sum scaled once: d * xd * sum(q * xq), plus
 *   m * xd * sum(xq) for Q4_1's minimum, minus 8 * d * xd * sum(xq) for Q4_0's offset. A third
 *   fewer instructions, but a block with an outlier (real hidden states have them) rounds its
 *   other activations coarsely: SmolLM2's greedy answers then part from exact mode's.
 * The blocks of 32 that SmolLM2 and llama.cpp's Q4/Q8 files use (Q4_0, Q4_1, Q8_0) have code of
 * their own on both paths; Q4_K and Q6_K (Gemma's Q4_K_M file) on the int8 path (their blocks'
 * integer sums, see row_dot_q4_k); with AVX2, Q5_0, Q4_K and Q6_K on the float and int16 paths
 * too (below, one loop for both);
 * the rest (Q5_K, and all but Q4_0, Q4_1 and Q8_0 in the portable build) are dequantized a row
 * at a time into a buffer in L1 and then multiplied there. One thread of a Zen 3 EPYC (AVX2), in
 * cache, each format's streamed row against its dequantized one: Q5_0 2048 x 640 0.51 -> 0.19
 * ms, Q4_K 640 x 1024 0.16 -> 0.09, Q6_K 640 x 2048 2.11 -> 0.19 (int8: 0.065 and 0.095).
 *
 * quant_dequantize: the float32 weights of some rows, for the many-row path (prefill), which
 * multiplies tiles of them with a float32 GEMM.
 *
 * The x86 AVX2 path (with FMA and F16C) is compiled where the target has them (-march=native);
 * elsewhere the portable scalar path is, which computes the same integer sums. The float path's
 * code is one source for AVX2 and AVX-512 (F, BW, VL, with VNNI): each block's weights made
 * bytes, then widened to 8 or 16 float lanes (fvec). Q5_0's weights (Gemma 3's q, k, gate and
 * up) are their nibbles less 16 where the fifth bit is clear (the fifth bits a mask register
 * with AVX-512, spread to a byte mask with AVX2). Each format and count of x's rows has a loop
 * of its own (STREAM_CASES), and one row of x (one sequence's decode step) takes four weight rows
 * a pass in the formats of 32 weights a block (stream_blocks). With AVX-512 the int8 path sums a
 * block's products with one VNNI dot product (vpdpbusd) where AVX2 takes two instructions. On
 * an AMD EPYC (Zen 4), one thread, a Q4_1 3072 x 576 matrix: float 0.211 -> 0.165 ms with 16
 * lanes; int8 with 512-bit vectors of two blocks (their nibbles gathered by three inserts) was
 * slower than AVX2's, 0.163 against 0.126.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_formats.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QUANT_AVX512 1
#endif
#endif

/* The formats with code of their own on the streaming paths (see the top of the file). */
static int streamed(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

/* The same for the float path: with AVX2, Q5_0 (Gemma 3's q, k, gate and up), Q4_K and Q6_K
 * (its o and down) too. */
static int float_streamed(int type) {
#ifdef QUANT_AVX2
    return streamed(type) || type == Q5_0 || type == Q4_K || type == Q6_K;
#else
    return streamed(type);
#endif
}

/* The two halves at p as floats (a block's scale and Q4_1's minimum): one conversion with F16C. */
static inline void half_pair_at(const uint8_t *p, float *first, float *second) {
#ifdef QUANT_AVX2
    const __m128 both = _mm_cvtph_ps(_mm_loadu_si32(p));
    *first = _mm_cvtss_f32(both);
    *second = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
    *first = half_to_float(p);
    *second = half_to_float(p + 2);
#endif
}

/* One row of activations quantized per block: q[cols], and each block's scale and quant sum. */
static void quantize_activations(const float *x, int64_t blocks, int8_t *q, float *scale,
                                 int32_t *sum) {
    for (int64_t b = 0; b < blocks; ++b, x += BLOCK, q += BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < BLOCK; ++i) {
            q[i] = (int8_t)nearbyintf(x[i] * inverse); /* |x * inverse| <= 127 (+ rounding) */
            s += q[i];
        }
        scale[b] = amax / 127.0f;
        sum[b] = s;
    }
}

#ifdef QUANT_AVX2
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight int32 partial sums of the 32 nibbles at qs (low nibbles first) times the int8 at xq.
 * maddubs multiplies unsigned by signed bytes; its pair sums (at most 2 * 15 * 127) fit int16. */
static inline __m256i nibble_products(const uint8_t *qs, const int8_t *xq) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    const __m256i nibbles = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
#ifdef QUANT_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, x), _mm256_set1_epi16(1));
#endif
}

/* The same for 32 signed weights: |w| times xq carrying w's sign (maddubs's unsigned side must
 * be |w|; -128 becomes 128 there, still exact, and 2 * 128 * 127 fits int16). */
static inline __m256i int8_products(const int8_t *w, const int8_t *xq) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
#ifdef QUANT_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv),
                               _mm256_sign_epi8(xv, wv));
#else
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
#else
static inline int32_t nibble_products(const uint8_t *qs, const int8_t *xq) {
    int32_t s = 0;
    for (int i = 0; i < BLOCK / 2; ++i) s += (qs[i] & 0x0F) * xq[i] + (qs[i] >> 4) * xq[i + 16];
    return s;
}

static inline int32_t int8_products(const int8_t *w, const int8_t *xq) {
    int32_t s = 0;
    for (int i = 0; i < BLOCK; ++i) s += w[i] * xq[i];
    return s;
}
#endif

/* The dot product of one stored row with one quantized activation row. */
static float row_dot_int8(int type, const uint8_t *row, int64_t blocks, const int8_t *xq,
                     const float *xd, const int32_t *xs) {
    const int64_t stride = block_bytes(type);
    float extra = 0.0f; /* the minimum's or offset's part: per block, a multiple of sum(xq) */
#ifdef QUANT_AVX2
    __m256 acc = _mm256_setzero_ps();
#define ACCUMULATE(products, factor) \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(factor), acc)
#else
    float acc = 0.0f;
#define ACCUMULATE(products, factor) acc += (float)(products) * (factor)
#endif
    for (int64_t b = 0; b < blocks; ++b, row += stride, xq += BLOCK) {
        float d, m; /* m: Q4_1's minimum; the next two bytes of the others' blocks */
        half_pair_at(row, &d, &m);
        const float scale = d * xd[b];
        switch (type) {
        case Q4_0:
            ACCUMULATE(nibble_products(row + 2, xq), scale);
            extra -= 8.0f * scale * (float)xs[b];
            break;
        case Q4_1:
            ACCUMULATE(nibble_products(row + 4, xq), scale);
            extra += m * xd[b] * (float)xs[b];
            break;
        default: /* Q8_0 */
            ACCUMULATE(int8_products((const int8_t *)(row + 2), xq), scale);
        }
    }
#undef ACCUMULATE
#ifdef QUANT_AVX2
    return horizontal_sum(acc) + extra;
#else
    return acc + extra;
#endif
}

/* Whether the float path streams a format's blocks, expanding them in registers (1), or
 * dequantizes each row into a buffer first (0): what PAGEDBATCH_QUANT_ACTIVATIONS=auto asks. */
int quant_float_streamed(int type) { return float_streamed(type); }

/* Which path was compiled: 3 for AVX-512 with VNNI, 2 for AVX2, 0 for the portable one. */
int quant_kernel_isa(void) {
#if defined(QUANT_AVX512)
    return 3;
#elif defined(QUANT_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* Rows ahead whose blocks a streaming loop asks for while it multiplies the current one: with the
 * hardware prefetcher alone, weights not in cache (a decode step's) streamed at 2.3 GB/s on one
 * Xeon core that reads 17.9; four rows ahead, 5.0 (a Q4_1 3072 x 576 matrix, 0.48 -> 0.22 ms).
 * Into L2 (prefetcht1): the non-temporal hint (prefetchnta, into L1 only) held Gemma 3's tied
 * LM head (Q8_0, 262,144 x 640, 170 MiB) to 11.5 GB/s on two cores of the AMX Xeon, 15.5 ms a
 * token; into L2, 18.3 GB/s, 9.8 ms (no prefetching: 13.5 ms; prefetcht0: 10.1; 16 KiB ahead
 * in place of four rows: no better). Eight rows, since one token's products take four rows a pass
 * (stream_blocks), are two passes ahead: on two cores of a Zen 4 EPYC, alternating runs, that
 * head 8.2-10.2 -> 6.9-7.2 ms and a Q4_1 196,608 x 576 matrix 4.4-4.9 -> 3.6-4.1 ms. */
enum { PREFETCH_ROWS = 8, PREFETCH_LOCALITY = 2 };

static inline void prefetch_row(const uint8_t *w, int64_t r, int64_t rows, int64_t row_bytes) {
    if (r + PREFETCH_ROWS >= rows) return;
    const uint8_t *ahead = w + (r + PREFETCH_ROWS) * row_bytes;
    for (int64_t offset = 0; offset < row_bytes; offset += 64)
        __builtin_prefetch(ahead + offset, 0, PREFETCH_LOCALITY);
}

/* The K formats on the int8 path (llama.cpp's vec_dot_q4_K_q8_K and vec_dot_q6_K_q8_K, with the
 * activations quantized per block of 32 as above where llama.cpp takes one scale per 256: each
 * sub-block's integer sum is scaled by its own activation scale, so an outlier coarsens only its
 * own 32 activations). The weights stay integers too:
 * - Q4_K: sub-block j of a super-block sums sum(q * xq) (q its nibbles, 0..15); its part is
 *   d * sc[j] * xd * that, less dmin * mn[j] * xd * sum(xq) for its minimum.
 * - Q6_K: sub-blocks of 16, q six bits (0..63) less 32: sum((q - 32) * xq) is taken as
 *   sum(q * xq) - 32 * sum(xq) pair by pair in 16-bit lanes (each at most 2 * 63 * 127, their
 *   difference at most 2 * 32 * 127), multiplied by the sub-block's int8 scale in the pairs' sum
 *   to 32 bits (vpmaddwd, at most 2 * 8128 * 128); then scaled by d * xd. */

/* Q4_K's and Q5_K's eight six-bit scales (bytes 0-7) and minimums (8-15) of a super-block: its
 * 12 packed bytes as three little-endian words, the top two bits of the first eight bytes going
 * to bits 4 and 5 of the last four sub-blocks'. */
static inline void k_scales_bytes(const uint8_t *packed, uint8_t out[16]) {
    uint32_t a, b, c;
    memcpy(&a, packed, 4);
    memcpy(&b, packed + 4, 4);
    memcpy(&c, packed + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, bits45 = 0x30303030u;
    const uint32_t words[4] = {a & low6, (c & low4) | ((a >> 2) & bits45), b & low6,
                               ((c >> 4) & low4) | ((b >> 2) & bits45)};
    memcpy(out, words, sizeof words);
}

#if defined(QUANT_AVX512)
/* One Q4_K row with one quantized activation row, a vector of 64 weights (a run of 32 bytes, its
 * low nibbles sub-block 2g, its high ones 2g + 1: 64 consecutive weights) per VNNI product; lane
 * i of the product belongs to sub-block 2g + i / 8, whose scale d * sc * xd a permute spreads. */
static float row_dot_q4_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd,
                          const int32_t *xs) {
    __m512 acc = _mm512_setzero_ps();
    __m256 minimums = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t s = 0; s < supers; ++s, row += 144, xq += SUPER_BLOCK, xd += 8, xs += 8) {
        const __m128 dm = _mm_cvtph_ps(_mm_loadu_si32(row));
        uint8_t scales[16];
        k_scales_bytes(row + 4, scales);
        const __m128i packed = _mm_loadu_si128((const __m128i *)scales);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
        const __m256 x_scale = _mm256_loadu_ps(xd);
        const __m256 x_sum = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)xs));
        minimums = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_mul_ps(x_scale, x_sum)),
                                   _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(dm))), minimums);
        const __m512 lane_scales = _mm512_castps256_ps512(_mm256_mul_ps(sc, x_scale));
        __m512 super = _mm512_setzero_ps();
        for (int g = 0; g < 4; ++g) {
            const __m256i run = _mm256_loadu_si256((const __m256i *)(row + 16 + 32 * g));
            const __m512i q = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(run), _mm256_srli_epi16(run, 4), 1),
                low4);
            const __m512i products = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(), q, _mm512_loadu_si512((const void *)(xq + 64 * g)));
            const __m512i pick = _mm512_set_epi32(2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                                  2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                                  2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g,
                                                  2 * g, 2 * g);
            super = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products),
                                    _mm512_permutexvar_ps(pick, lane_scales), super);
        }
        acc = _mm512_fmadd_ps(super, _mm512_broadcastss_ps(dm), acc);
    }
    return _mm512_reduce_add_ps(acc) - horizontal_sum(minimums);
}

/* The same for Q6_K: 64 weights a vector, the low nibbles of a half's 64 bytes of ql (its
 * weights 0-63) or their high nibbles (64-127), each with its two top bits from qh shifted to
 * bits 4 and 5 (a different shift for each run of 32, in 16-bit lanes: bits that cross from the
 * neighbouring byte are masked off). In the 16-bit pair sums, lanes 8t to 8t + 7 belong to
 * sub-block t of the four; after vpmaddwd, 32-bit lanes 0-7 to the first block of 32, 8-15 to the
 * second. */
static float row_dot_q6_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i offset = _mm512_set1_epi8(32);
    /* left shifts taking bits (0, 1) and (2, 3) to (4, 5); right shifts taking (4, 5), (6, 7) */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int64_t s = 0; s < supers; ++s, row += 210, xq += SUPER_BLOCK, xd += 8) {
        const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(row + 192));
        const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scale_bytes)); /* 16 */
        const __m512 x_scales = _mm512_castps256_ps512(_mm256_loadu_ps(xd));
        __m512 super = _mm512_setzero_ps();
        for (int half = 0; half < 2; ++half) {
            const __m512i ql = _mm512_loadu_si512((const void *)(row + 64 * half));
            const __m512i qh = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(row + 128 + 32 * half)));
            const __m512i runs[2] = {
                _mm512_or_si512(_mm512_and_si512(ql, low4),
                                _mm512_and_si512(_mm512_sllv_epi16(qh, left), bits45)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                _mm512_and_si512(_mm512_srlv_epi16(qh, right), bits45)),
            };
            for (int r = 0; r < 2; ++r) {
                const int first = 8 * half + 4 * r; /* its first sub-block of 16 */
                const __m512i x = _mm512_loadu_si512((const void *)(xq + 128 * half + 64 * r));
                const __m512i pairs = _mm512_sub_epi16(_mm512_maddubs_epi16(runs[r], x),
                                                       _mm512_maddubs_epi16(offset, x));
                const __m512i which_scale = _mm512_set_epi16(
                    first + 3, first + 3, first + 3, first + 3, first + 3, first + 3, first + 3,
                    first + 3, first + 2, first + 2, first + 2, first + 2, first + 2, first + 2,
                    first + 2, first + 2, first + 1, first + 1, first + 1, first + 1, first + 1,
                    first + 1, first + 1, first + 1, first, first, first, first, first, first,
                    first, first);
                const __m512i sums =
                    _mm512_madd_epi16(pairs, _mm512_permutexvar_epi16(which_scale, scales));
                const int block = first / 2;
                const __m512i which_block = _mm512_set_epi32(
                    block + 1, block + 1, block + 1, block + 1, block + 1, block + 1, block + 1,
                    block + 1, block, block, block, block, block, block, block, block);
                super = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                        _mm512_permutexvar_ps(which_block, x_scales), super);
            }
        }
        acc = _mm512_fmadd_ps(super, _mm512_set1_ps(half_to_float(row + 208)), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif defined(QUANT_AVX2)
/* AVX2: a sub-block of 32 weights a vector, each scaled by a broadcast d * sc * xd. */
static float row_dot_q4_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd,
                          const int32_t *xs) {
    __m256 acc = _mm256_setzero_ps();
    float minimums = 0.0f;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t s = 0; s < supers; ++s, row += 144, xq += SUPER_BLOCK, xd += 8, xs += 8) {
        float d, dmin;
        half_pair_at(row, &d, &dmin);
        uint8_t scales[16];
        k_scales_bytes(row + 4, scales);
        for (int j = 0; j < 8; ++j) minimums += dmin * (float)scales[8 + j] * xd[j] * (float)xs[j];
        for (int g = 0; g < 4; ++g) {
            const __m256i run = _mm256_loadu_si256((const __m256i *)(row + 16 + 32 * g));
            const __m256i q[2] = {_mm256_and_si256(run, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(run, 4), low4)};
            for (int t = 0; t < 2; ++t) {
                const int j = 2 * g + t;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * j));
                const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], x), ones);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                      _mm256_set1_ps(d * (float)scales[j] * xd[j]), acc);
            }
        }
    }
    return horizontal_sum(acc) - minimums;
}

static float row_dot_q6_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i offset = _mm256_set1_epi8(32);
    for (int64_t s = 0; s < supers; ++s, row += 210, xq += SUPER_BLOCK, xd += 8) {
        const float d = half_to_float(row + 208);
        const int8_t *scales = (const int8_t *)(row + 192);
        for (int half = 0; half < 2; ++half) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(row + 128 + 32 * half));
            const __m256i high[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh,
                                     _mm256_srli_epi16(qh, 2)};
            for (int k = 0; k < 4; ++k) {
                const __m256i ql =
                    _mm256_loadu_si256((const __m256i *)(row + 64 * half + 32 * (k % 2)));
                const __m256i low = k < 2 ? ql : _mm256_srli_epi16(ql, 4);
                const __m256i q = _mm256_or_si256(_mm256_and_si256(low, low4),
                                                  _mm256_and_si256(high[k], bits45));
                const int block = 4 * half + k;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * block));
                const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(q, x),
                                                       _mm256_maddubs_epi16(offset, x));
                const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(scales[2 * block + 1]),
                                                       _mm_set1_epi16(scales[2 * block]));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale)),
                                      _mm256_set1_ps(d * xd[block]), acc);
            }
        }
    }
    return horizontal_sum(acc);
}
#else
/* Portable: the same integer sums, a weight at a time. */
static float row_dot_q4_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd,
                          const int32_t *xs) {
    float acc = 0.0f;
    for (int64_t s = 0; s < supers; ++s, row += 144, xq += SUPER_BLOCK, xd += 8, xs += 8) {
        const float d = half_to_float(row), dmin = half_to_float(row + 2);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            k_scale_min(row + 4, j, &sc, &mn);
            const uint8_t *run = row + 16 + 32 * (j / 2);
            int32_t sum = 0;
            for (int l = 0; l < 32; ++l)
                sum += (j % 2 ? run[l] >> 4 : run[l] & 0x0F) * xq[32 * j + l];
            acc += d * (float)sc * xd[j] * (float)sum - dmin * (float)mn * xd[j] * (float)xs[j];
        }
    }
    return acc;
}

static float row_dot_q6_k(const uint8_t *row, int64_t supers, const int8_t *xq, const float *xd) {
    float acc = 0.0f;
    for (int64_t s = 0; s < supers; ++s, row += 210, xq += SUPER_BLOCK, xd += 8) {
        const float d = half_to_float(row + 208);
        const int8_t *scales = (const int8_t *)(row + 192);
        for (int half = 0; half < 2; ++half) {
            const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
            for (int k = 0; k < 4; ++k) {
                const int block = 4 * half + k;
                for (int t = 0; t < 2; ++t) { /* the block's two sub-blocks of 16 */
                    int32_t sum = 0;
                    for (int l = 16 * t; l < 16 * t + 16; ++l) {
                        const uint8_t bits = ql[l + 32 * (k % 2)];
                        const int low = k < 2 ? bits & 0x0F : bits >> 4;
                        const int q = (low | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
                        sum += q * xq[32 * block + l];
                    }
                    acc += d * (float)scales[2 * block + t] * xd[block] * (float)sum;
                }
            }
        }
    }
    return acc;
}
#endif

/* The int8 path's formats: the blocks of 32 above, and Q4_K and Q6_K (Gemma 3's Q4_K_M file). */
static int int8_streamed(int type) { return streamed(type) || type == Q4_K || type == Q6_K; }

/* One stored row of any int8 format with one quantized activation row of `blocks` blocks of 32. */
static float int8_row(int type, const uint8_t *row, int64_t blocks, const int8_t *xq,
                      const float *xd, const int32_t *xs) {
    if (type == Q4_K) return row_dot_q4_k(row, blocks / 8, xq, xd, xs);
    if (type == Q6_K) return row_dot_q6_k(row, blocks / 8, xq, xd);
    return row_dot_int8(type, row, blocks, xq, xd, xs);
}

static void dequantize_row(int type, const uint8_t *row, int64_t cols, float *out) {
    const int64_t size = block_size(type), stride = block_bytes(type);
    for (int64_t c = 0; c < cols; c += size, row += stride) dequantize_block(type, row, out + c);
}

/* The dot product of two float rows of a multiple of 32. */
static float dot_floats(const float *a, const float *b, int64_t n) {
#ifdef QUANT_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    return horizontal_sum(_mm256_add_ps(acc0, acc1));
#else
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
#endif
}

/* The float path for formats without code of their own: each row dequantized into a buffer of
 * the thread's, then multiplied with every row of x. */
static int dequantized_rows_times(int type, const uint8_t *w, int64_t rows, int64_t cols,
                                  const float *x, int64_t n, int num_threads, float *out) {
    const int64_t row_bytes = stored_row_bytes(type, cols);
    const int parallel = rows * cols * n >= (1 << 16);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        float *buffer = malloc(sizeof *buffer * (size_t)cols);
        if (!buffer) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!buffer) continue;
            prefetch_row(w, r, rows, row_bytes);
            dequantize_row(type, w + r * row_bytes, cols, buffer);
            for (int64_t i = 0; i < n; ++i)
                out[i * rows + r] = dot_floats(buffer, x + i * cols, cols);
        }
        free(buffer);
    }
    return failed ? -2 : 0;
}

/* Per block of 32 activations, their sum: Q4_0's offset and Q4_1's minimum multiply it. */
static void block_sums(const float *x, int64_t blocks, float *sum) {
    for (int64_t b = 0; b < blocks; ++b, x += BLOCK) {
        float s = 0.0f;
        for (int i = 0; i < BLOCK; ++i) s += x[i];
        sum[b] = s;
    }
}

/* The activations a streaming product reads, one row: float32 as they are (x), or int16 per
 * block of 32 (xq, each block's scale xd: x ~ xd * xq). xsum: each block's float sum, which
 * Q4_0's offset, Q4_1's and Q4_K's minimums multiply, on either path. */
struct activations {
    const float *x;
    const int16_t *xq;
    const float *xd;
    const float *xsum;
};

#ifdef QUANT_AVX2
/* The float and int16 paths' vectors: one source for AVX2 (8 lanes) and AVX-512 (16), whose
 * helpers below come in one version a width. A block's weights are first made bytes (its
 * integers, signed or not, 16 in a __m128i, the formats' own code below), then widened to floats
 * and multiplied with the activations lane by lane (or to int16 and multiplied with theirs);
 * each block's or sub-block's sum is scaled once by its scale. */
#ifdef QUANT_AVX512
typedef __m512 fvec;
static inline fvec fvec_zero(void) { return _mm512_setzero_ps(); }
static inline float fvec_sum(fvec v) { return _mm512_reduce_add_ps(v); }
static inline fvec fvec_scaled(fvec v, float scale, fvec acc) {
    return _mm512_fmadd_ps(v, _mm512_set1_ps(scale), acc);
}
static inline fvec fvec_add(fvec a, fvec b) { return _mm512_add_ps(a, b); }

/* 16 weights (the bytes of v) times x[0:16], lane by lane. */
static inline fvec sixteen_times(__m128i v, int is_signed, const float *x) {
    const __m512i w = is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_loadu_ps(x));
}
#else
typedef __m256 fvec;
static inline fvec fvec_zero(void) { return _mm256_setzero_ps(); }
static inline float fvec_sum(fvec v) { return horizontal_sum(v); }
static inline fvec fvec_scaled(fvec v, float scale, fvec acc) {
    return _mm256_fmadd_ps(v, _mm256_set1_ps(scale), acc);
}
static inline fvec fvec_add(fvec a, fvec b) { return _mm256_add_ps(a, b); }

/* 16 weights (the bytes of v) times x[0:16], their products summed in 8 lanes. */
static inline fvec sixteen_times(__m128i v, int is_signed, const float *x) {
    const __m128i upper = _mm_srli_si128(v, 8);
    const __m256i a = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
    const __m256i b = is_signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
    const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_loadu_ps(x + 8), s);
}
#endif

/* 32 weights (the bytes of v) times x[0:32]. */
static inline fvec thirty_two_times(__m256i v, int is_signed, const float *x) {
    return fvec_add(sixteen_times(_mm256_castsi256_si128(v), is_signed, x),
                    sixteen_times(_mm256_extracti128_si256(v, 1), is_signed, x + 16));
}

/* The int16 activations' products: the weights widened to int16, multiplied with xq and summed
 * in pairs (vpmaddwd, exact in int32: at most 2 * 128 * 32767 a pair), the pairs of a block
 * added, then made floats. Each returns the sums in an fvec's lanes. */
#ifdef QUANT_AVX512
static inline fvec sixteen_sums(__m128i v, int is_signed, const int16_t *xq) {
    const __m256i w = is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
    const __m256i pairs = _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    return _mm512_zextps256_ps512(_mm256_cvtepi32_ps(pairs));
}

static inline fvec thirty_two_sums(__m256i v, int is_signed, const int16_t *xq) {
    const __m512i w = is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512((const void *)xq)));
}
#else
static inline fvec sixteen_sums(__m128i v, int is_signed, const int16_t *xq) {
    const __m256i w = is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)xq)));
}

static inline fvec thirty_two_sums(__m256i v, int is_signed, const int16_t *xq) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m256i wl = is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
    const __m256i wh = is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
    const __m256i sums =
        _mm256_add_epi32(_mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i *)xq)),
                         _mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i *)(xq + 16))));
    return _mm256_cvtepi32_ps(sums);
}
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Rows of x one pass over the weights takes on the streaming paths: each block is expanded once
 * and multiplied with all of them (their accumulators, one vector each, in registers). */
enum { STREAM_ROWS = 8 };

/* acc + scale times the products of 32 weights (the bytes of v) with the activations from
 * column k: x's floats, or (ints) xq's integers, whose block's scale then joins `scale`. */
ALWAYS_INLINE fvec add_32(__m256i v, int is_signed, const struct activations *a, int64_t k,
                          float scale, fvec acc, int ints) {
    if (ints)
        return fvec_scaled(thirty_two_sums(v, is_signed, a->xq + k), scale * a->xd[k / BLOCK],
                           acc);
    return fvec_scaled(thirty_two_times(v, is_signed, a->x + k), scale, acc);
}

/* The same for 16 weights (v) from column k. */
ALWAYS_INLINE fvec add_16(__m128i v, int is_signed, const struct activations *a, int64_t k,
                          float scale, fvec acc, int ints) {
    if (ints)
        return fvec_scaled(sixteen_sums(v, is_signed, a->xq + k), scale * a->xd[k / BLOCK], acc);
    return fvec_scaled(sixteen_times(v, is_signed, a->x + k), scale, acc);
}

/* Q5_0's weights from its nibbles q (bytes, weight i in byte i): less 16 where bit i of the
 * fifth bits qh is clear. AVX-512 takes qh as a mask; AVX2 spreads each byte of qh over eight
 * bytes (a shuffle within each 128-bit half) and tests each of those for its own bit. */
static inline __m256i fifth_bits(__m256i q, uint32_t qh) {
#ifdef QUANT_AVX512
    return _mm256_mask_sub_epi8(q, (__mmask32)~qh, q, _mm256_set1_epi8(16));
#else
    return _mm256_sub_epi8(q, _mm256_andnot_si256(set_bit_bytes(qh), _mm256_set1_epi8(16)));
#endif
}

/* The formats of 32 weights a block: a block's weights as bytes, its scale d, and m (Q4_1's
 * minimum; the next two bytes of the others' blocks). Q5_0's q - 16 is built as bytes
 * (fifth_bits). */
ALWAYS_INLINE __m256i block_weights(int type, const uint8_t *block, float *d, float *m) {
    half_pair_at(block, d, m);
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    /* the nibbles follow d (Q4_0), d and m (Q4_1), d and qh (Q5_0) */
    const int64_t at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6;
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + at));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                       _mm256_set1_epi8(0x0F));
    if (type != Q5_0) return q;
    uint32_t qh;
    memcpy(&qh, block + 2, sizeof qh);
    return fifth_bits(q, qh);
}

/* The part of a block's product that multiplies the block's activation sum: Q4_0's offset and
 * Q4_1's minimum (none for the signed formats). */
ALWAYS_INLINE float block_offset(int type, float d, float m) {
    return type == Q4_1 ? m : type == Q4_0 ? -8.0f * d : 0.0f;
}

/* Weight rows a pass takes where x is one row (a decode step of one sequence): see
 * stream_blocks. */
enum { ROW_GROUP = 4 };

/* nw consecutive rows of a format of 32 weights a block (row_bytes apart) against nx rows of x:
 * d times each block's integers' products with the activations, block_offset times the block's
 * activation sum (xsum), into result[g + i * nw] for weight row g and x's row i. Each block is
 * expanded once for all of x's rows (at most STREAM_ROWS), and one row of x takes ROW_GROUP
 * weight rows (nx 1, nw ROW_GROUP): a row of these formats is 18 to 20 blocks in the two real
 * models, and taken one at a time each row's horizontal sum and dispatch took about a quarter of
 * a one-token product's time. */
ALWAYS_INLINE void stream_blocks(int type, const uint8_t *row, int64_t row_bytes, int nw,
                                 int64_t blocks, const struct activations *a, int nx, int ints,
                                 float *result) {
    const int64_t stride = block_bytes(type);
    fvec acc[ROW_GROUP][STREAM_ROWS];
    float extra[ROW_GROUP][STREAM_ROWS];
#pragma GCC unroll 4
    for (int g = 0; g < nw; ++g)
#pragma GCC unroll 8
        for (int i = 0; i < nx; ++i) acc[g][i] = fvec_zero(), extra[g][i] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b, row += stride) {
#pragma GCC unroll 4
        for (int g = 0; g < nw; ++g) {
            float d, m;
            const __m256i q = block_weights(type, row + g * row_bytes, &d, &m);
            const float offset = block_offset(type, d, m);
#pragma GCC unroll 8
            for (int i = 0; i < nx; ++i) {
                if (type == Q4_0 || type == Q4_1) extra[g][i] += offset * a[i].xsum[b];
                acc[g][i] = add_32(q, type == Q8_0 || type == Q5_0, &a[i], b * BLOCK, d,
                                   acc[g][i], ints);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < nw; ++g)
#pragma GCC unroll 8
        for (int i = 0; i < nx; ++i) result[g + i * nw] = fvec_sum(acc[g][i]) + extra[g][i];
}

/* The K formats a sub-block at a time, its sum scaled by its own scale. Q4_K: each run of 32
 * bytes holds sub-block 2g in its low nibbles, 2g + 1 in its high; each sub-block's minimum
 * multiplies its activation sum (xsum, per 32 as its sub-blocks). */
ALWAYS_INLINE void stream_q4_k(const uint8_t *row, int64_t supers, const struct activations *a,
                               int nx, int ints, float *result) {
    fvec acc[STREAM_ROWS];
    float extra[STREAM_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < nx; ++i) acc[i] = fvec_zero(), extra[i] = 0.0f;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < supers; ++s, row += 144) {
        float d, dmin;
        half_pair_at(row, &d, &dmin);
        uint8_t scales[16];
        k_scales_bytes(row + 4, scales);
        for (int g = 0; g < 4; ++g) {
            const __m256i run = _mm256_loadu_si256((const __m256i *)(row + 16 + 32 * g));
            const __m256i halves[2] = {_mm256_and_si256(run, low4),
                                       _mm256_and_si256(_mm256_srli_epi16(run, 4), low4)};
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * g + h;
                const int64_t k = s * SUPER_BLOCK + 32 * j;
                const float minimum = dmin * (float)scales[8 + j];
#pragma GCC unroll 8
                for (int i = 0; i < nx; ++i) {
                    acc[i] = add_32(halves[h], 0, &a[i], k, d * (float)scales[j], acc[i], ints);
                    extra[i] -= minimum * a[i].xsum[k / BLOCK];
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nx; ++i) result[i] = fvec_sum(acc[i]) + extra[i];
}

/* Q6_K: 32 weights of one k of a half (two sub-blocks of 16, each its own scale) from 32 bytes
 * of ql (a nibble each) and 32 of qh (two bits each), less 32 as signed bytes. */
ALWAYS_INLINE void stream_q6_k(const uint8_t *row, int64_t supers, const struct activations *a,
                               int nx, int ints, float *result) {
    fvec acc[STREAM_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < nx; ++i) acc[i] = fvec_zero();
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    for (int64_t s = 0; s < supers; ++s, row += 210) {
        const float d = half_to_float(row + 208);
        const int8_t *scales = (const int8_t *)(row + 192);
        for (int half = 0; half < 2; ++half) {
            const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
            const __m256i high_bits = _mm256_loadu_si256((const __m256i *)qh);
            for (int k = 0; k < 4; ++k) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(ql + 32 * (k % 2)));
                const __m256i low = k < 2 ? _mm256_and_si256(bits, low4)
                                          : _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(high_bits, 2 * k), low2);
                const __m256i q = _mm256_sub_epi8(
                    _mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
                const int64_t column = s * SUPER_BLOCK + 128 * half + 32 * k;
                const int8_t *sc = scales + 8 * half + 2 * k;
                const float first = d * (float)sc[0], second = d * (float)sc[1];
#pragma GCC unroll 8
                for (int i = 0; i < nx; ++i) {
                    acc[i] = add_16(_mm256_castsi256_si128(q), 1, &a[i], column, first, acc[i],
                                    ints);
                    acc[i] = add_16(_mm256_extracti128_si256(q, 1), 1, &a[i], column + 16, second,
                                    acc[i], ints);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nx; ++i) result[i] = fvec_sum(acc[i]);
}

/* One stored row of a format with code of its own here, with nx rows of activations. */
ALWAYS_INLINE void stream_row(int type, const uint8_t *row, int64_t blocks,
                              const struct activations *a, int nx, int ints, float *result) {
    if (type == Q4_K)
        stream_q4_k(row, blocks / 8, a, nx, ints, result);
    else if (type == Q6_K)
        stream_q6_k(row, blocks / 8, a, nx, ints, result);
    else
        stream_blocks(type, row, 0, 1, blocks, a, nx, ints, result);
}

/* stream_row with the format and nx constants in each case: its accumulators stay registers,
 * and each loop holds one format's code, no branch on the format a block. */
#define STREAM_NX(format, ints)                                                                    \
    switch (nx) {                                                                                  \
    case 1: stream_row(format, row, blocks, a, 1, ints, result); return;                           \
    case 2: stream_row(format, row, blocks, a, 2, ints, result); return;                           \
    case 3: stream_row(format, row, blocks, a, 3, ints, result); return;                           \
    case 4: stream_row(format, row, blocks, a, 4, ints, result); return;                           \
    case 5: stream_row(format, row, blocks, a, 5, ints, result); return;                           \
    case 6: stream_row(format, row, blocks, a, 6, ints, result); return;                           \
    case 7: stream_row(format, row, blocks, a, 7, ints, result); return;                           \
    default: stream_row(format, row, blocks, a, STREAM_ROWS, ints, result); return;                \
    }
#define STREAM_CASES(ints)                                                                         \
    switch (type) {                                                                                \
    case Q4_0: STREAM_NX(Q4_0, ints)                                                               \
    case Q4_1: STREAM_NX(Q4_1, ints)                                                               \
    case Q5_0: STREAM_NX(Q5_0, ints)                                                               \
    case Q8_0: STREAM_NX(Q8_0, ints)                                                               \
    case Q4_K: STREAM_NX(Q4_K, ints)                                                               \
    default: STREAM_NX(Q6_K, ints) /* float_streamed's formats alone come here */                  \
    }

static void stream_row_float(int type, const uint8_t *row, int64_t blocks,
                             const struct activations *a, int nx, float *result) {
    STREAM_CASES(0)
}

static void stream_row_int16(int type, const uint8_t *row, int64_t blocks,
                             const struct activations *a, int nx, float *result) {
    STREAM_CASES(1)
}
#undef STREAM_CASES
#undef STREAM_NX

/* The formats whose one row of x takes ROW_GROUP weight rows a pass (stream_blocks). */
static int grouped(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0;
}

/* stream_blocks of ROW_GROUP weight rows and one row of x, the format a constant in each case,
 * for each kind of activations. */
#define GROUP_CASE(format, ints)                                                                   \
    case format:                                                                                   \
        stream_blocks(format, row, row_bytes, ROW_GROUP, blocks, a, 1, ints, result);              \
        return;
#define GROUP_CASES(ints)                                                                          \
    switch (type) {                                                                                \
        GROUP_CASE(Q4_0, ints)                                                                     \
        GROUP_CASE(Q4_1, ints)                                                                     \
        GROUP_CASE(Q5_0, ints)                                                                     \
    default: /* Q8_0, the last grouped format */                                                   \
        GROUP_CASE(Q8_0, ints)                                                                     \
    }

static void stream_group_float(int type, const uint8_t *row, int64_t row_bytes, int64_t blocks,
                               const struct activations *a, float *result) {
    GROUP_CASES(0)
}

static void stream_group_int16(int type, const uint8_t *row, int64_t row_bytes, int64_t blocks,
                               const struct activations *a, float *result) {
    GROUP_CASES(1)
}
#undef GROUP_CASES
#undef GROUP_CASE
#endif

#ifndef QUANT_AVX2
/* The portable float path: the dot product of one stored row of Q4_0, Q4_1 or Q8_0 with one
 * float32 activation row, a weight at a time. */
static float row_dot_float(int type, const uint8_t *row, int64_t blocks, const float *x,
                           const float *xsum) {
    const int64_t stride = block_bytes(type);
    float extra = 0.0f, acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b, row += stride, x += BLOCK) {
        const float d = half_to_float(row);
        if (type == Q4_0) extra -= 8.0f * d * xsum[b];
        if (type == Q4_1) extra += half_to_float(row + 2) * xsum[b];
        float s = 0.0f;
        if (type == Q8_0) {
            const int8_t *q = (const int8_t *)(row + 2);
            for (int i = 0; i < BLOCK; ++i) s += (float)q[i] * x[i];
        } else {
            const uint8_t *qs = row + (type == Q4_1 ? 4 : 2);
            for (int i = 0; i < BLOCK / 2; ++i)
                s += (float)(qs[i] & 0x0F) * x[i] + (float)(qs[i] >> 4) * x[i + 16];
        }
        acc += d * s;
    }
    return acc + extra;
}
#endif

/* One row of x quantized per block of 32 to int16: xd = max |x| / 32767, xq = round(x / xd), so
 * that an activation moves by at most xd / 2: 2^-16 of its block's largest, 1/258 of int8's. */
static void quantize_int16(const float *x, int64_t blocks, int16_t *xq, float *xd) {
    for (int64_t b = 0; b < blocks; ++b, x += BLOCK, xq += BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < BLOCK; ++i) xq[i] = (int16_t)nearbyintf(x[i] * inverse);
        xd[b] = amax / 32767.0f;
    }
}

/* The formats the int16 path reads: those with streaming code, where AVX2 is compiled. */
static int int16_streamed(int type) {
#ifdef QUANT_AVX2
    return float_streamed(type);
#else
    (void)type;
    return 0;
#endif
}

int quant_int16_streamed(int type) { return int16_streamed(type); }

/* out[n, rows] for a format the float path streams: with x as it is, or (ints) quantized to
 * int16. Returns 0, or -2 where the activations' scratch cannot be allocated. */
static int streamed_product(int type, const uint8_t *w, int64_t rows, int64_t cols,
                            const float *x, int64_t n, int num_threads, float *out, int ints) {
    const int64_t blocks = cols / BLOCK;
    float *xsum = malloc(sizeof *xsum * (size_t)(n * blocks) + 1);
    float *xd = ints ? malloc(sizeof *xd * (size_t)(n * blocks) + 1) : NULL;
    int16_t *xq = ints ? malloc(sizeof *xq * (size_t)(n * cols) + 1) : NULL;
    if (!xsum || (ints && (!xd || !xq))) {
        free(xsum), free(xd), free(xq);
        return -2;
    }
    for (int64_t i = 0; i < n; ++i) {
        block_sums(x + i * cols, blocks, xsum + i * blocks);
        if (ints) quantize_int16(x + i * cols, blocks, xq + i * cols, xd + i * blocks);
    }
    const int64_t row_bytes = stored_row_bytes(type, cols);
    const int parallel = rows * cols * n >= (1 << 16);
#ifdef QUANT_AVX2
    /* Each row of x's activations: a pass over a weight row takes STREAM_ROWS of them, and one
     * row of x alone takes ROW_GROUP weight rows a pass (stream_blocks). */
    struct activations *acts = malloc(sizeof *acts * (size_t)n);
    if (!acts) {
        free(xsum), free(xd), free(xq);
        return -2;
    }
    for (int64_t i = 0; i < n; ++i)
        acts[i] = (struct activations){
            .x = x + i * cols,
            .xq = ints ? xq + i * cols : NULL,
            .xd = ints ? xd + i * blocks : NULL,
            .xsum = xsum + i * blocks,
        };
    if (n == 1 && grouped(type)) {
        const int64_t groups = rows / ROW_GROUP;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t r = g * ROW_GROUP;
            for (int64_t k = r; k < r + ROW_GROUP; ++k) prefetch_row(w, k, rows, row_bytes);
            (ints ? stream_group_int16 : stream_group_float)(type, w + r * row_bytes, row_bytes,
                                                             blocks, acts, out + r);
        }
        for (int64_t r = groups * ROW_GROUP; r < rows; ++r)
            (ints ? stream_row_int16 : stream_row_float)(type, w + r * row_bytes, blocks, acts, 1,
                                                         out + r);
    } else {
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            prefetch_row(w, r, rows, row_bytes);
            const uint8_t *row = w + r * row_bytes;
            for (int64_t i = 0; i < n; i += STREAM_ROWS) {
                const int nx = n - i < STREAM_ROWS ? (int)(n - i) : STREAM_ROWS;
                float result[STREAM_ROWS];
                (ints ? stream_row_int16 : stream_row_float)(type, row, blocks, acts + i, nx,
                                                             result);
                for (int j = 0; j < nx; ++j) out[(i + j) * rows + r] = result[j];
            }
        }
    }
    free(acts);
#else
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        prefetch_row(w, r, rows, row_bytes);
        for (int64_t i = 0; i < n; ++i)
            out[i * rows + r] = row_dot_float(type, w + r * row_bytes, blocks, x + i * cols,
                                              xsum + i * blocks);
    }
#endif
    free(xsum), free(xd), free(xq);
    return 0;
}

/* out[n, rows] = x @ dequantized(w).T with the activations as they are (stream_row_float; the
 * portable build's row_dot_float). Returns as quant_matmul_int8 does. */
int quant_matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                       int64_t n, int num_threads, float *out) {
    if (block_bytes(type) == 0 || cols % block_size(type) != 0) return -1;
    if (!float_streamed(type))
        return dequantized_rows_times(type, w, rows, cols, x, n, num_threads, out);
    return streamed_product(type, w, rows, cols, x, n, num_threads, out, 0);
}

/* out[n, rows] = x @ dequantized(w).T with x quantized per block to int16 (quantize_int16): the
 * weights' and activations' integers multiplied exactly, each block's sum scaled once. Its error
 * is at most the sum over blocks of xd / 2 times sum |w|, then float32's rounding. As fast as the
 * int8 path (one Zen 3 thread, Q4_1 3072 x 576 in cache: float 0.197 ms, int16 0.133, int8
 * 0.127), 1/258 of its activations' rounding. Returns as quant_matmul_int8 does; -1 also for a
 * format int16_streamed does not read (the portable build: none). */
int quant_matmul_int16(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                       int64_t n, int num_threads, float *out) {
    if (!int16_streamed(type) || cols % block_size(type) != 0) return -1;
    return streamed_product(type, w, rows, cols, x, n, num_threads, out, 1);
}

/* out[n, rows] = x @ dequantized(w).T with int8 activations (see row_dot_int8). Returns 0; -1
 * for a type it does not read or cols not a multiple of 32 (nothing written), -2 where the
 * activations' scratch cannot be allocated. */
int quant_matmul_int8(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                      int64_t n, int num_threads, float *out) {
    const int64_t blocks = cols / BLOCK;
    if (!int8_streamed(type) || cols % block_size(type) != 0) return -1;
    int8_t *xq = malloc((size_t)(n * cols) + 1);
    float *xd = malloc(sizeof *xd * (size_t)(n * blocks) + 1);
    int32_t *xs = malloc(sizeof *xs * (size_t)(n * blocks) + 1);
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -2;
    }
    for (int64_t i = 0; i < n; ++i)
        quantize_activations(x + i * cols, blocks, xq + i * cols, xd + i * blocks,
                             xs + i * blocks);
    const int64_t row_bytes = stored_row_bytes(type, cols);
    /* Waking the other threads costs more than a small matrix's whole product. */
    const int parallel = rows * cols * n >= (1 << 16);
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        prefetch_row(w, r, rows, row_bytes);
        for (int64_t i = 0; i < n; ++i)
            out[i * rows + r] = int8_row(type, w + r * row_bytes, blocks, xq + i * cols,
                                         xd + i * blocks, xs + i * blocks);
    }
    free(xq), free(xd), free(xs);
    return 0;
}

/* out[rows, cols] = the weights of `rows` stored rows, in float32. Returns 0, or -1 as above. */
int quant_dequantize(int type, const uint8_t *w, int64_t rows, int64_t cols, int num_threads,
                     float *out) {
    const int64_t stride = block_bytes(type);
    if (stride == 0 || cols % block_size(type) != 0) return -1;
    const int64_t row_bytes = stored_row_bytes(type, cols);
    const int parallel = rows * cols >= (1 << 16);
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        dequantize_row(type, w + r * row_bytes, cols, out + r * cols);
    return 0;
}
