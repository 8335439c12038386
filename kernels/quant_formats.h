/* The GGUF block formats that quant_matmul.c (a few rows) and quant_gemm.c (many rows) read, in
 * one place: their ggml type numbers, a block's bytes and weights, the half-precision scales,
 * bfloat16's rounding (quant_gemm.c's products, decode_layer.c's cache writes), the K formats'
 * packed six-bit scales, and a block's float32 weights (layouts in quant_blocks.py, which holds
 * the same tables for the Python side).
 *
 * Everything here is static inline: each C file that includes it is compiled into a library of
 * its own (native.py), and the functions are small enough to be inlined where they are called.
 * native.py hashes this header into both libraries' build digests, so an edit rebuilds them.
 */
#ifndef PAGEDBATCH_QUANT_FORMATS_H
#define PAGEDBATCH_QUANT_FORMATS_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { BLOCK = 32, SUPER_BLOCK = 256 };
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Bytes a block of each format takes; 0 for a type these kernels do not read. */
static inline int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Weights a block of a format these kernels read holds. */
static inline int64_t block_size(int type) { return type >= Q4_K ? SUPER_BLOCK : BLOCK; }

/* Bytes a stored row of `cols` weights of `type` takes (cols a whole number of its blocks). */
static inline int64_t stored_row_bytes(int type, int64_t cols) {
    return cols / block_size(type) * block_bytes(type);
}

/* The little-endian IEEE half at p, as a float (exact: every half is a float). */
static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else { /* a subnormal half is a normal float: shift its mantissa up to the implicit bit */
        uint32_t shifts = 0;
        while (!(man & 0x400u)) man <<= 1, ++shifts;
        bits = sign | ((113 - shifts) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if defined(__AVX2__)
/* 0xFF in each byte i of 32 whose bit i of qh is set, 0 in the others: Q5_0's fifth bits. */
static inline __m256i set_bit_bytes(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i own = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, own), own);
}
#endif

/* f rounded to the nearest bfloat16, ties to even (the hardware's rounding for finite values;
 * a NaN stays a NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K's and Q5_K's six-bit scale and minimum of sub-block j (of 8), packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The float32 weights of one stored block (block_size(type) of them). Each is its exact value
 * rounded once (see quant_blocks.dequantize): a scale's product with a small integer is exact in
 * float32 (the K formats' d * sc too: 11 bits times 6), and a fused or separate multiply-add
 * rounds once. */
static inline void dequantize_block(int type, const uint8_t *b, float *o) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const float d = half_to_float(b);
        const float m = type == Q4_1 ? half_to_float(b + 2) : -8.0f * d;
        const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
        for (int i = 0; i < BLOCK / 2; ++i) {
            o[i] = d * (float)(qs[i] & 0x0F) + m;
            o[i + 16] = d * (float)(qs[i] >> 4) + m;
        }
        return;
    }
    case Q5_0: {
        const float d = half_to_float(b);
        const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                            (uint32_t)b[5] << 24;
        for (int i = 0; i < BLOCK / 2; ++i) {
            const int lo = (b[6 + i] & 0x0F) | (int)((qh >> i) & 1u) << 4;
            const int hi = (b[6 + i] >> 4) | (int)((qh >> (i + 16)) & 1u) << 4;
            o[i] = d * (float)(lo - 16);
            o[i + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case Q8_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < BLOCK; ++i) o[i] = d * (float)(int8_t)b[2 + i];
        return;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (type == Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            k_scale_min(b + 4, j, &sc, &mn);
            const float scale = d * (float)sc, low = dmin * (float)mn;
            const uint8_t *run = qs + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) {
                int q = j % 2 ? run[l] >> 4 : run[l] & 0x0F;
                if (type == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                o[32 * j + l] = scale * (float)q - low;
            }
        }
        return;
    }
    default: { /* Q6_K */
        const float d = half_to_float(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, scales += 8, o += 128)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < 32; ++l) {
                    const uint8_t bits = ql[l + 32 * (k % 2)];
                    const int low = k < 2 ? bits & 0x0F : bits >> 4;
                    const int q = (low | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
                    o[32 * k + l] = d * (float)scales[(32 * k + l) / 16] * (float)q;
                }
    }
    }
}

#endif
