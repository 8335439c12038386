/* The many-row product with GGUF block-quantized weights (layouts in quant_blocks.py):
 * out[n, rows] = x[n, cols] @ dequantized(w).T for a prefill or a decode step of many sequences,
 * where quant_matmul.c's streaming kernels (a few rows) would read every block once per row.
 *
 * The weights are taken a panel of PANEL (32) rows at a time: each block of the panel is expanded
 * once a call, rounded to bfloat16, and packed into a buffer of the thread's (K x 32 x 2 bytes:
 * 36 KiB for 576 columns, 96 KiB for 1536, in L2), in the pair-interleaved order of the bf16 dot
 * products (x86's VNNI layout: for each pair of columns k, k + 1, the 32 rows' two weights side
 * by side). The activations are rounded to bfloat16 once a call. Every row of x is multiplied
 * with the packed panel before the next panel is expanded, so the expansion is paid once per
 * weight however many rows there are, and the products run at the bf16 units' rate:
 * - amx (Intel AMX-BF16, Sapphire Rapids and later): 16 x 16 float32 tiles, each
 *   tdpbf16ps multiplying 16 rows of x by 16 weight rows over 32 columns (one block);
 * - avx512 (AVX512-BF16: Zen 4, Cooper Lake and later): vdpbf16ps, 12 rows of x by the 32 weight
 *   rows in 24 float32 vectors, two columns a step;
 * - portable: the same roundings and products in plain C (a reference for the other two on any
 *   CPU; slower than torch's float32 GEMM, so quant_linear takes this file only where one of the
 *   two above is compiled).
 * All three sum float32 products of bf16-rounded weights and activations: a product's error is at
 * most 2^-7 of |x w| (two roundings of 2^-8 each), well under the weights' own quantization step
 * (1/16 of a block's range for Q4), and the sums are float32's.
 *
 * Rows of x go in chunks of CHUNK (256): a chunk's bf16 activations (256 x 1536 x 2 = 768 KiB)
 * stay in L2 while every panel passes over them; a longer prefill expands the weights once a
 * chunk. OpenMP splits the panels among the threads.
 *
 * The second half of the file takes the activations as integers instead (int16, the default on
 * AVX512-VNNI CPUs for most weights, or int8): the panel then holds the weights' stored
 * integers, and their sums are exact (see "Integer activations" below).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_formats.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
#define GEMM_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define GEMM_AMX 1
#endif
#endif

enum { PANEL = 32, CHUNK = 256, ROWS_AVX512 = 12, AMX_ROWS = 32 };
enum { PATH_PORTABLE = 0, PATH_AVX512 = 1, PATH_AMX = 2 };

/* Whether both products read rows of `cols` of `type`: a type they read, whole blocks. */
static int reads(int type, int64_t cols) {
    return block_bytes(type) != 0 && cols > 0 && cols % block_size(type) == 0;
}

/* Brings panel p's stored rows (none past the matrix's end) towards the cache while the panel
 * before it is multiplied: packing reads them PANEL rows abreast, streams that the hardware's
 * prefetchers do not follow, and waited on memory for most of its time. */
static void prefetch_panel(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t p) {
    if (p * PANEL >= rows) return;
    const int64_t count = rows - p * PANEL < PANEL ? rows - p * PANEL : PANEL;
    const uint8_t *start = w + p * PANEL * row_bytes;
    for (int64_t at = 0; at < count * row_bytes; at += 64) __builtin_prefetch(start + at, 0, 2);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 vectors of 16 lanes transposed in registers: lane j of r[k] becomes lane k of r[j]. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int k = 0; k < 16; k += 2) { /* pairs of rows interleaved within 128-bit lanes */
        t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) { /* lane L of r[k + q]: column 4L + q of rows k .. k + 3 */
        r[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
        r[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
        r[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
        r[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int q = 0; q < 4; ++q) { /* columns q, 4 + q, 8 + q, 12 + q gathered from the lanes */
        const __m512 v0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88);
        const __m512 w0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xDD);
        const __m512 v1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88);
        const __m512 w1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xDD);
        t[q] = _mm512_shuffle_f32x4(v0, v1, 0x88);
        t[4 + q] = _mm512_shuffle_f32x4(w0, w1, 0x88);
        t[8 + q] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
        t[12 + q] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
    }
    for (int k = 0; k < 16; ++k) r[k] = t[k];
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Expanding. With `passes` 3 each weight w is split into two bf16, h = bf16(w) and
 * l = bf16(w - h), and each activation a likewise, and a product is taken as
 * a_h w_h + a_h w_l + a_l w_h (bf16x3): three bf16 products in place of one, w and a then held to
 * 2^-16 of themselves, a product's error under 2^-14 of |a w|: float32's accuracy, near enough
 * that greedy answers follow exact mode's. The three are laid along the columns: a weight row's
 * expansion is [h, l, h] (3 x cols), an activation row's [h, h, l], so the kernels see one longer
 * dot product. With `passes` 1, h alone (bf16, a product's error under 2^-7 of |a w|).
 *
 * Two layouts: the AVX-512 and portable paths' panel is pair-interleaved (panel[kp * PANEL + r]
 * holds row r's expanded columns 2 kp, low half, and 2 kp + 1, high half); the AMX path's is row
 * by row (row r's expanded columns at panel + r * kcols), see pack_rows_amx. Rows past the
 * matrix's end are zeros. */

/* 32 floats of row r at (expanded) column c (a multiple of 32), portable: bf16 pairs placed. */
static void place_pairs_portable(const uint16_t *v, uint32_t *panel, int64_t c, int r) {
    for (int i = 0; i < BLOCK / 2; ++i)
        panel[(c / 2 + i) * PANEL + r] = (uint32_t)v[2 * i] | (uint32_t)v[2 * i + 1] << 16;
}

/* Row r's 32 weights at columns c .. c + 31 (f), expanded by `passes` into a pair-interleaved
 * panel of kcols = passes * cols expanded columns. */
static void emit_portable(const float *f, int passes, int64_t cols, uint32_t *panel, int64_t c,
                          int r) {
    uint16_t h[BLOCK], l[BLOCK];
    for (int i = 0; i < BLOCK; ++i) {
        h[i] = to_bf16(f[i]);
        l[i] = to_bf16(f[i] - from_bf16(h[i]));
    }
    place_pairs_portable(h, panel, c, r);
    if (passes == 3) {
        place_pairs_portable(l, panel, cols + c, r);
        place_pairs_portable(h, panel, 2 * cols + c, r);
    }
}

#ifdef GEMM_AVX512
/* 32 floats (lo: the first 16, hi: the rest) rounded to bf16, and what rounding left of them. */
static inline void split_avx512(__m512 lo, __m512 hi, __m512i *h, __m512i *l) {
    const __m512bh rounded = _mm512_cvtne2ps_pbh(hi, lo);
    *h = (__m512i)rounded;
    const __m512 back_lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(*h));
    const __m512 back_hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(*h, 1));
    *l = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, back_hi), _mm512_sub_ps(lo, back_lo));
}

/* 16 rows' 16 bf16 pairs each (v[r]: row r0 + r's pairs at expanded columns c .. c + 31) into
 * the pair-interleaved panel: transposed in registers, so that pair j of the 16 rows is one
 * aligned store (where a row at a time needs a scatter of 16 dwords PANEL apart). */
static inline void place_rows_avx512(__m512 v[16], uint32_t *panel, int64_t c, int r0) {
    transpose16(v);
    for (int j = 0; j < 16; ++j) _mm512_store_ps((float *)(panel + (c / 2 + j) * PANEL + r0), v[j]);
}

/* emit_portable's work with the 32 weights in two vectors, into the row `rows` of a row-by-row
 * panel (AMX's). */
static inline void emit_avx512(__m512 lo, __m512 hi, int passes, int64_t cols, uint16_t *rows,
                               int64_t c) {
    __m512i h, l;
    if (passes == 3)
        split_avx512(lo, hi, &h, &l);
    else
        h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(rows + c, h);
    if (passes == 3) {
        _mm512_storeu_si512(rows + cols + c, l);
        _mm512_storeu_si512(rows + 2 * cols + c, h);
    }
}

/* One block of the formats of 32 with code of their own: its weights in two vectors. */
static inline void block_vectors(int type, const uint8_t *b, __m512 *lo, __m512 *hi) {
    const __m128 dm = _mm_cvtph_ps(_mm_loadu_si32(b));
    const __m512 d = _mm512_broadcastss_ps(dm);
    if (type == Q8_0) {
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(b + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(b + 18)))));
        return;
    }
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == Q4_1 ? 4 : 2))));
    const __m512 m = type == Q4_1 ? _mm512_broadcastss_ps(_mm_movehdup_ps(dm))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    *lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), m);
    *hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
}
#endif

#ifdef GEMM_AVX512
/* The AVX-512 path's pair-interleaved panel: the panel's rows (`panel_w`, `valid` of them) taken
 * 16 at a time, block column by block column; each 32 columns of the 16 rows split into bf16
 * parts, one vector a row, then transposed into place (place_rows_avx512). Rows past `valid` are
 * zeros. `scratch` holds 16 blocks' floats (K formats, expanded by the scalar code). */
static void pack_pairs_avx512(int type, const uint8_t *panel_w, int64_t row_bytes, int64_t cols,
                              int valid, int passes, uint32_t *panel, float *scratch) {
    const int64_t size = block_size(type), stride = block_bytes(type);
    const int direct = type == Q4_0 || type == Q4_1 || type == Q8_0;
    for (int r0 = 0; r0 < PANEL; r0 += 16) {
        const int here = valid - r0 >= 16 ? 16 : valid - r0 > 0 ? valid - r0 : 0;
        const uint8_t *base = panel_w + r0 * row_bytes;
        for (int64_t c = 0; c < cols; c += size) {
            const int64_t at = c / size * stride;
            if (!direct)
                for (int r = 0; r < here; ++r)
                    dequantize_block(type, base + r * row_bytes + at, scratch + r * size);
            for (int64_t i = 0; i < size; i += BLOCK) {
                __m512 h[16], l[16];
                for (int r = 0; r < 16; ++r) {
                    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                    if (r < here && direct)
                        block_vectors(type, base + r * row_bytes + at, &lo, &hi);
                    else if (r < here) {
                        lo = _mm512_loadu_ps(scratch + r * size + i);
                        hi = _mm512_loadu_ps(scratch + r * size + i + 16);
                    }
                    __m512i hv, lv = _mm512_setzero_si512();
                    if (passes == 3)
                        split_avx512(lo, hi, &hv, &lv);
                    else
                        hv = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                    h[r] = _mm512_castsi512_ps(hv);
                    l[r] = _mm512_castsi512_ps(lv);
                }
                if (passes == 3) {
                    place_rows_avx512(l, panel, cols + c + i, r0);
                    for (int j = 0; j < 16; ++j) l[j] = h[j];
                    place_rows_avx512(l, panel, 2 * cols + c + i, r0);
                }
                place_rows_avx512(h, panel, c + i, r0);
            }
        }
    }
}
#endif

/* Panel p of w (its rows p * PANEL ..., at most `rows` in all) expanded by `passes`: into the
 * pair-interleaved `panel`, or (`row_panel` not NULL, AMX) row by row into `row_panel`.
 * `scratch` holds 16 blocks' floats. `vectors`: with AVX-512 (the portable code otherwise). */
static void pack_panel(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t p,
                       int passes, uint32_t *panel, uint16_t *row_panel, float *scratch,
                       int vectors) {
    const int64_t size = block_size(type), stride = block_bytes(type);
    const int64_t row_bytes = stored_row_bytes(type, cols), kcols = passes * cols;
    const int valid = rows - p * PANEL < PANEL ? (int)(rows - p * PANEL) : PANEL;
#ifdef GEMM_AVX512
    if (vectors && !row_panel) {
        pack_pairs_avx512(type, w + p * PANEL * row_bytes, row_bytes, cols, valid, passes, panel,
                          scratch);
        return;
    }
#endif
    (void)vectors;
    if (valid < PANEL) {
        if (row_panel)
            memset(row_panel + valid * kcols, 0, 2 * (size_t)((PANEL - valid) * kcols));
        else
            memset(panel, 0, sizeof *panel * (size_t)(kcols / 2 * PANEL));
    }
    for (int r = 0; r < valid; ++r) {
        const uint8_t *row = w + (p * PANEL + r) * row_bytes;
#ifdef GEMM_AVX512
        uint16_t *to_row = row_panel ? row_panel + r * kcols : NULL;
        if (vectors && (type == Q4_0 || type == Q4_1 || type == Q8_0)) {
            for (int64_t c = 0; c < cols; c += BLOCK, row += stride) {
                __m512 lo, hi;
                block_vectors(type, row, &lo, &hi);
                emit_avx512(lo, hi, passes, cols, to_row, c);
            }
            continue;
        }
#endif
        for (int64_t c = 0; c < cols; c += size, row += stride) {
            dequantize_block(type, row, scratch);
            for (int64_t i = 0; i < size; i += BLOCK) {
#ifdef GEMM_AVX512
                if (vectors) {
                    emit_avx512(_mm512_loadu_ps(scratch + i), _mm512_loadu_ps(scratch + i + 16),
                                passes, cols, to_row, c + i);
                    continue;
                }
#endif
                emit_portable(scratch + i, passes, cols, panel, c + i, r);
            }
        }
    }
}

/* x's rows [start, start + count) expanded by `passes` ([h, h, l], see above) into xb, row by row
 * (kcols a row), then zero rows up to `padded`: the AVX-512 and portable paths' activations. */
static void activations_rows(const float *x, int64_t start, int64_t count, int64_t padded,
                             int64_t cols, int passes, uint16_t *xb, int vectors) {
    const int64_t kcols = passes * cols;
    (void)vectors;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < padded; ++i) {
        uint16_t *o = xb + i * kcols;
        if (i >= count) {
            memset(o, 0, sizeof *o * (size_t)kcols);
            continue;
        }
        const float *row = x + (start + i) * cols;
#ifdef GEMM_AVX512
        if (vectors) {
            for (int64_t c = 0; c < cols; c += 32) {
                __m512i h, l;
                split_avx512(_mm512_loadu_ps(row + c), _mm512_loadu_ps(row + c + 16), &h, &l);
                _mm512_storeu_si512(o + c, h);
                if (passes == 3) {
                    _mm512_storeu_si512(o + cols + c, h);
                    _mm512_storeu_si512(o + 2 * cols + c, l);
                }
            }
            continue;
        }
#endif
        for (int64_t c = 0; c < cols; ++c) {
            const uint16_t h = to_bf16(row[c]);
            o[c] = h;
            if (passes == 3) {
                o[cols + c] = h;
                o[2 * cols + c] = to_bf16(row[c] - from_bf16(h));
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * The products of a packed panel with the chunk's activations. Each writes out[i, j] for the
 * chunk's rows i < count and the panel's valid columns j < valid (out's row stride ldo). */

static void panel_portable(const uint16_t *xb, int64_t count, int64_t cols, const uint32_t *panel,
                           int valid, float *out, int64_t ldo) {
    for (int64_t i = 0; i < count; ++i) {
        float acc[PANEL] = {0};
        const uint16_t *a = xb + i * cols;
        for (int64_t kp = 0; kp < cols / 2; ++kp) {
            const float a0 = from_bf16(a[2 * kp]), a1 = from_bf16(a[2 * kp + 1]);
            const uint32_t *b = panel + kp * PANEL;
            for (int j = 0; j < PANEL; ++j)
                acc[j] += a0 * from_bf16((uint16_t)b[j]) + a1 * from_bf16((uint16_t)(b[j] >> 16));
        }
        for (int j = 0; j < valid; ++j) out[i * ldo + j] = acc[j];
    }
}

#ifdef GEMM_AVX512
/* `mr` (at most ROWS_AVX512) rows of x by the panel's 32 rows, in 2 * mr float32 vectors: a
 * step takes two columns, broadcasting each row's bf16 pair against the panel's 32 pairs. */
static inline __attribute__((always_inline)) void rows_avx512(int mr, const uint16_t *xb,
                                                              int64_t cols, const uint32_t *panel,
                                                              __mmask16 mask0, __mmask16 mask1,
                                                              float *out, int64_t ldo) {
    __m512 acc[ROWS_AVX512][2];
#pragma GCC unroll 12
    for (int m = 0; m < mr; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint32_t *a = (const uint32_t *)xb;
    const int64_t lda = cols / 2;
    for (int64_t kp = 0; kp < cols / 2; ++kp) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kp * PANEL);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kp * PANEL + 16);
#pragma GCC unroll 12
        for (int m = 0; m < mr; ++m) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[m * lda + kp]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, b1);
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < mr; ++m) {
        _mm512_mask_storeu_ps(out + m * ldo, mask0, acc[m][0]);
        _mm512_mask_storeu_ps(out + m * ldo + 16, mask1, acc[m][1]);
    }
}

static void panel_avx512(const uint16_t *xb, int64_t count, int64_t cols, const uint32_t *panel,
                         int valid, float *out, int64_t ldo) {
    const __mmask16 mask0 = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
    const __mmask16 mask1 = valid >= 32   ? 0xffff
                            : valid <= 16 ? 0
                                          : (__mmask16)((1u << (valid - 16)) - 1);
    int64_t i = 0;
    for (; i + ROWS_AVX512 <= count; i += ROWS_AVX512)
        rows_avx512(ROWS_AVX512, xb + i * cols, cols, panel, mask0, mask1, out + i * ldo, ldo);
    /* The tail, with its row count a constant in each case (the accumulators stay registers). */
    const uint16_t *a = xb + i * cols;
    float *o = out + i * ldo;
    switch (count - i) {
#define TAIL(n) \
    case n: rows_avx512(n, a, cols, panel, mask0, mask1, o, ldo); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
    default: break;
    }
}
#endif

#ifdef GEMM_AMX
/* Linux hands a process AMX's 8 KiB of tile state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asked once, for every thread. */
static int amx_permitted(void) {
    static int state = 0; /* 0 unasked, 1 granted, -1 refused */
    int seen;
#pragma omp atomic read
    seen = state;
    if (seen == 0) {
        seen = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
#pragma omp atomic write
        state = seen;
    }
    return seen == 1;
}

/* The tile configuration (palette 1): tiles 0-3 the float32 results (16 weight rows by 16 rows of
 * x), 4-5 the panel's two halves (16 weight rows of 32 bf16 columns), 6-7 two blocks of x's rows
 * (16 column pairs of 16 rows' pairs). Every tile 16 rows of 64 bytes. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* x's rows [start, start + count) expanded by `passes` as the tiles' right operand: xv[kp *
 * padded + i] holds row i's expanded columns 2 kp and 2 kp + 1 in bf16; rows count .. padded
 * are zeros. */
static void activations_amx(const float *x, int64_t start, int64_t count, int64_t padded,
                            int64_t cols, int passes, uint32_t *xv) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)padded));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < padded; ++i) {
        const float *row = x + (start + i) * cols;
        for (int64_t c = 0; c < cols; c += 32) {
            __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
            if (i < count)
                split_avx512(_mm512_loadu_ps(row + c), _mm512_loadu_ps(row + c + 16), &h, &l);
            _mm512_i32scatter_epi32(xv + (c / 2) * padded + i, at, h, 4);
            if (passes == 3) {
                _mm512_i32scatter_epi32(xv + ((cols + c) / 2) * padded + i, at, h, 4);
                _mm512_i32scatter_epi32(xv + ((2 * cols + c) / 2) * padded + i, at, l, 4);
            }
        }
    }
}

/* A 16 x 16 result tile (16 weight rows by 16 rows of x), stored at `scratch`, into out
 * transposed: out[i * ldo + j] for x's rows i < xs and weight rows j < ws. */
static inline void store_transposed(const float *scratch, float *out, int64_t ldo, int64_t xs,
                                    int64_t ws) {
    if (xs <= 0 || ws <= 0) return;
    __m512 r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_load_ps(scratch + 16 * k);
    transpose16(r);
    const __mmask16 mask = ws >= 16 ? 0xffff : (__mmask16)((1u << ws) - 1);
    for (int i = 0; i < 16 && i < xs; ++i) _mm512_mask_storeu_ps(out + i * ldo, mask, r[i]);
}

/* The chunk's rows (xv padded with zero rows to a multiple of AMX_ROWS) by the panel. */
static void panel_amx(const uint32_t *xv, int64_t count, int64_t padded, int64_t cols,
                      const uint16_t *panel, int valid, float *out, int64_t ldo, float *scratch) {
    const int64_t a_stride = cols * (int64_t)sizeof(uint16_t), b_stride = padded * 4;
    const uint16_t *upper = panel + 16 * cols;
    for (int64_t i = 0; i < count; i += AMX_ROWS) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < cols; c += BLOCK) {
            const uint32_t *b = xv + (c / 2) * padded + i;
            _tile_loadd(4, panel + c, a_stride);
            _tile_loadd(5, upper + c, a_stride);
            _tile_loadd(6, b, b_stride);
            _tile_loadd(7, b + 16, b_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        float *o = out + i * ldo;
        const int64_t left = count - i;
        _tile_stored(0, scratch, 64);
        store_transposed(scratch, o, ldo, left, valid);
        _tile_stored(1, scratch, 64);
        store_transposed(scratch, o + 16 * ldo, ldo, left - 16, valid);
        _tile_stored(2, scratch, 64);
        store_transposed(scratch, o + 16, ldo, left, valid - 16);
        _tile_stored(3, scratch, 64);
        store_transposed(scratch, o + 16 * ldo + 16, ldo, left - 16, valid - 16);
    }
}
#endif

/* Which paths were compiled and can run here: bit PATH_x set for each (the portable one always). */
int quant_gemm_paths(void) {
    int paths = 1 << PATH_PORTABLE;
#ifdef GEMM_AVX512
    paths |= 1 << PATH_AVX512;
#endif
#ifdef GEMM_AMX
    if (amx_permitted()) paths |= 1 << PATH_AMX;
#endif
    return paths;
}

/* out[n, rows] = x[n, cols] @ dequantized(w).T (w: `rows` stored rows of `type`) by `path`, in
 * `passes` bf16 products (1 or 3, see above). Returns 0; -1 for a type it does not read, cols not
 * a whole number of blocks, or passes not 1 or 3 (nothing
 * written); -2 where its buffers cannot be allocated; -3 for a path not compiled or not
 * permitted here. */
int quant_gemm(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n,
               int path, int passes, int num_threads, float *out) {
    if (!reads(type, cols) || (passes != 1 && passes != 3)) return -1;
    if (path < 0 || path > PATH_AMX || !(quant_gemm_paths() & (1 << path))) return -3;
    if (n <= 0 || rows <= 0) return 0;
    const int64_t chunk = n < CHUNK ? n : CHUNK, kcols = passes * cols;
    const int64_t row_bytes = stored_row_bytes(type, cols);
    const int64_t padded = (chunk + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    uint16_t *xb = aligned_alloc(64, sizeof *xb * (size_t)(padded * kcols));
    if (!xb) return -2;
    const int64_t panels = (rows + PANEL - 1) / PANEL;
    const int vectors = path != PATH_PORTABLE, amx = path == PATH_AMX;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint32_t *panel = aligned_alloc(64, sizeof *panel * (size_t)(kcols / 2 * PANEL));
        float *scratch = aligned_alloc(64, sizeof *scratch * 16 * SUPER_BLOCK);
        if (!panel || !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef GEMM_AMX
        if (amx) amx_configure();
#endif
        for (int64_t start = 0; start < n; start += chunk) {
            const int64_t count = n - start < chunk ? n - start : chunk;
            /* each ends in a barrier */
#ifdef GEMM_AMX
            if (amx)
                activations_amx(x, start, count, padded, cols, passes, (uint32_t *)xb);
            else
#endif
                activations_rows(x, start, count, padded, cols, passes, xb, vectors);
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) break; /* every thread sees it after the barrier: all leave together */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                const int valid = rows - p * PANEL < PANEL ? (int)(rows - p * PANEL) : PANEL;
                float *o = out + start * rows + p * PANEL;
                pack_panel(type, w, rows, cols, p, passes, panel, amx ? (uint16_t *)panel : NULL,
                           scratch, vectors);
                prefetch_panel(w, rows, row_bytes, p + 1);
                switch (path) {
#ifdef GEMM_AMX
                case PATH_AMX:
                    panel_amx((const uint32_t *)xb, count, padded, kcols, (const uint16_t *)panel,
                              valid, o, rows, scratch);
                    break;
#endif
#ifdef GEMM_AVX512
                case PATH_AVX512: panel_avx512(xb, count, kcols, panel, valid, o, rows); break;
#endif
                default: panel_portable(xb, count, kcols, panel, valid, o, rows);
                }
            } /* a barrier: xb is rewritten for the next chunk only after every panel's use */
        }
#ifdef GEMM_AMX
        if (amx) _tile_release();
#endif
        free(panel);
        free(scratch);
    }
    free(xb);
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Integer activations (PAGEDBATCH_QUANT_GEMM=int16 or int8). Each row of x is quantized per block
 * of 32 to `bits` signed integers: d = max |x| / L, q = round(x / d) in -L .. L (L = 32767 for
 * int16, 127 for int8 as llama.cpp's q8), and each weight kept as the stored integer it is,
 * unsigned, with its group's float scale s and offset m (w = s q + m: Q4_0 q - 8, Q5_0 q - 16,
 * Q8_0 q + 128 shifted to unsigned, Q4_1 and the K formats' mins; a group is 32 weights, Q6_K's 16
 * of their own scale). An output is then
 *     sum over groups g of  s_g xd_g (sum_k q_k xq_k)  +  m_g xd_g (sum_k xq_k),
 * the integer sums exact, the second term the product of the offset with the quantized
 * activations' sum: the whole is the exact weights times the quantized activations, whose error
 * is at most sum over blocks of d / 2 sum |w| (quant_matmul.c's bound), then float32's rounding.
 * - int16 (vpdpwssd: two products of int16 a lane, at most 2 * 255 * 32767 a pair and 16 pairs a
 *   group, under 2^29): 32 products an instruction, twice float32's FMA, each activation within
 *   2^-16 of its block's largest, as the few-row int16 kernels of quant_matmul.c, whose greedy
 *   answers follow exact mode's. The default on AVX512-VNNI CPUs, AMX's too but for large
 *   weights in Q4_0, Q4_1 and Q8_0 (quant_linear.gemm_path).
 * - int8 (vpdpbusd: unsigned weight bytes by signed activation bytes, four a lane), llama.cpp's
 *   arithmetic: 64 products an instruction, but SmolLM2's greedy answers with it matched exact
 *   mode's over 32 tokens in 6 chats of 16 (the gate asks 90%; perplexity +0.25%):
 *   benchmarks/README.md. Taken for the layers only where asked; the LM head's screen where
 *   AMX does not run (quant_linear.screen_product; its bound takes the measured quantization
 *   error, `quant_gemm_int_error`).
 * Without VNNI, AVX2 takes the same steps 8 lanes at a time (INT_AVX2): int16 by vpmaddwd, int8
 * by vpmaddubsw, whose int16 sum of two products bounds the activations against Q8_0's bytes to
 * 63 (`levels`), then vpmaddwd by ones.
 * The formats whose offset is a fixed multiple of the scale (Q4_0, Q5_0, Q8_0, Q6_K: `centre`)
 * take no offset term: one term a group, not two. With int16 their integers are kept signed,
 * q - centre; with int8 (whose weights vpdpbusd takes unsigned) the group's integer sum starts
 * from -centre times the activations' sum instead of 0.
 * The panel: pq[kd * PANEL + r] holds row r's weights at columns kd * per .. kd * per + per - 1,
 * per = 32 / bits of them in a dword (bytes for int8, int16 for int16); ps, pm[g * PANEL + r] its
 * group g's scale and offset. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define GEMM_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_AVX2 1
#include <immintrin.h>
#endif

enum { INT_PORTABLE = 0, INT_VNNI = 1, INT_AVX2 = 2 };
/* Rows of x a pass of the VNNI kernel, and of the AVX2 kernel with its vectors of 8 panel rows. */
enum { ROWS_VNNI = 6, ROWS_AVX2 = 3, AVX2_VECTORS = 2 };

static int group_size(int type) { return type == Q6_K ? 16 : BLOCK; }

/* Weights a dword of the panel holds, and bytes an activation takes. */
static inline int per_dword(int bits) { return 32 / bits; }
static inline int element_bytes(int bits) { return bits / 8; }

/* What block_integers' unsigned integers of a symmetric format are offset by (their offset is
 * -centre times the scale); 0 for the formats with a min of their own (Q4_1, Q4_K, Q5_K). */
static inline int centre(int type) {
    switch (type) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q8_0: return 128;
    case Q6_K: return 32;
    default: return 0;
    }
}

/* Whether the panel holds signed integers without offsets (see above). */
static inline int centred(int type, int bits) { return bits == 16 && centre(type) > 0; }

/* Whether an output takes the groups' offsets as a float term of their own (see above). */
static inline int offset_terms(int type) { return centre(type) == 0; }

/* Whether the integer products read rows of `cols` of `type` with activations of `bits` (8 or
 * 16). */
static int int_reads(int type, int64_t cols, int bits) {
    return reads(type, cols) && (bits == 8 || bits == 16);
}

/* The largest integer a block of activations is quantized to by `path`: 32767 for int16, 127 for
 * int8, but 63 for int8 against Q8_0 (whose unsigned integers reach 255) on AVX2: vpmaddubsw sums
 * two products in int16, and 2 * 255 * 63 stays within it (VNNI's vpdpbusd sums in int32). */
static inline int levels(int type, int bits, int path) {
    return bits == 16 ? 32767 : type == Q8_0 && path == INT_AVX2 ? 63 : 127;
}

/* One stored block's groups' scales s and offsets m: the weight k of group g is s[g] q[k] + m[g],
 * q its unsigned integer (block_integers). */
static void block_scales(int type, const uint8_t *b, float *s, float *m) {
    switch (type) {
    case Q4_1:
        s[0] = half_to_float(b);
        m[0] = half_to_float(b + 2);
        return;
    case Q4_0:
    case Q5_0:
    case Q8_0:
        s[0] = half_to_float(b);
        m[0] = -(float)centre(type) * s[0];
        return;
    case Q4_K:
    case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            k_scale_min(b + 4, j, &sc, &mn);
            s[j] = d * (float)sc;
            m[j] = -(dmin * (float)mn);
        }
        return;
    }
    default: { /* Q6_K: groups of 16 */
        const float d = half_to_float(b + 208);
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int g = 0; g < 16; ++g) s[g] = d * (float)scales[g], m[g] = -32.0f * s[g];
    }
    }
}

/* One stored block's weights as unsigned integers q (block_size(type) of them; see block_scales).
 */
static void block_integers(int type, const uint8_t *b, uint8_t *q) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) q[i] = qs[i] & 0x0F, q[i + 16] = qs[i] >> 4;
        return;
    }
    case Q5_0: {
        const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                            (uint32_t)b[5] << 24;
        for (int i = 0; i < 16; ++i) {
            q[i] = (uint8_t)((b[6 + i] & 0x0F) | ((qh >> i) & 1u) << 4);
            q[i + 16] = (uint8_t)((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1u) << 4);
        }
        return;
    }
    case Q8_0:
        for (int i = 0; i < BLOCK; ++i) q[i] = b[2 + i] ^ 0x80; /* int8 + 128 */
        return;
    case Q4_K:
    case Q5_K: {
        const uint8_t *qh = b + 16, *qs = b + (type == Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            const uint8_t *run = qs + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) {
                int v = j % 2 ? run[l] >> 4 : run[l] & 0x0F;
                if (type == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                q[32 * j + l] = (uint8_t)v;
            }
        }
        return;
    }
    default: { /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, q += 128)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < 32; ++l) {
                    const uint8_t bits = ql[l + 32 * (k % 2)];
                    const int low = k < 2 ? bits & 0x0F : bits >> 4;
                    q[32 * k + l] = (uint8_t)(low | ((qh[l] >> (2 * k)) & 3) << 4);
                }
    }
    }
}

#ifdef GEMM_AVX2
/* 0x10 in each byte i of 32 whose bit i of qh is set (Q5_0's fifth bits). */
static inline __m256i fifth_bits(uint32_t qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32)qh, 0x10);
#else
    return _mm256_and_si256(set_bit_bytes(qh), _mm256_set1_epi8(0x10));
#endif
}

/* Where a row's columns c .. c + 31 (c a multiple of 32) are stored: the offset of their block in
 * the row, and which run of 32 of it they are (0 but in a K format's super-block). The same for
 * every row of a matrix, so taken once for all the rows a pack reads. */
typedef struct {
    int64_t offset;
    int run;
} columns_at;

static inline columns_at columns(int type, int64_t c) {
    const int64_t size = block_size(type);
    return (columns_at){c / size * block_bytes(type), (int)(c % size / BLOCK)};
}

/* block_integers' 32 integers of a row's columns `at` in one vector: the block's, or a K format's
 * super-block's run at.run of 32. */
static inline __m256i integers_avx(int type, const uint8_t *row, columns_at at) {
    const uint8_t *b = row + at.offset;
    const int j = at.run;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                _mm256_set1_epi8((char)0x80));
    if (type == Q4_0 || type == Q4_1 || type == Q5_0) { /* 16 bytes: low nibbles, then high */
        const int64_t at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6;
        const __m128i v = _mm_loadu_si128((const __m128i *)(b + at));
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m256i q =
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        if (type != Q5_0) return q;
        uint32_t qh;
        memcpy(&qh, b + 2, sizeof qh); /* bit i: the fifth bit of weight i */
        return _mm256_or_si256(q, fifth_bits(qh));
    }
    if (type == Q4_K || type == Q5_K) { /* 32 bytes a pair of runs: low nibbles j even, high odd */
        const uint8_t *qs = b + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
        const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
        if (type == Q5_K) { /* bit j of qh[l]: the fifth bit of weight l */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(fifth, 4));
        }
        return q;
    }
    /* Q6_K: half j / 4 of 128 weights; its run k = j % 4 takes ql's low (k < 2) or high nibbles of
     * 32 bytes at 32 (k % 2), and bits 2k, 2k + 1 of qh's 32 bytes above them */
    const int half = j / 4, k = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (k % 2)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    const __m256i low = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
}

/* 8 vectors of 8 dwords transposed in registers: dword j of r[k] becomes dword k of r[j]. */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int k = 0; k < 8; k += 2) { /* dwords 0, 1, 4, 5 and 2, 3, 6, 7 of a pair of rows */
        t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) { /* u[k + q]: dwords q and 4 + q of rows k .. k + 3 */
        u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int q = 0; q < 4; ++q) {
        r[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
        r[4 + q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
    }
}

/* pack_int's integers with AVX2, 8 rows at a time: a row's 32 columns a vector (int8) or two
 * (int16, widened), transposed so that a dword of the 8 rows is one aligned store. */
static void pack_dwords_avx2(int type, int bits, const uint8_t *panel_w, int64_t row_bytes,
                             int64_t cols, int valid, uint32_t *pq) {
    const int per = per_dword(bits), halves = bits == 8 ? 1 : 2;
    const __m256i centred_by = _mm256_set1_epi16((short)(centred(type, bits) ? centre(type) : 0));
    for (int r0 = 0; r0 < PANEL; r0 += 8) {
        const int here = valid - r0 >= 8 ? 8 : valid - r0 > 0 ? valid - r0 : 0;
        const uint8_t *base = panel_w + r0 * row_bytes;
        for (int64_t c = 0; c < cols; c += BLOCK) {
            const columns_at at = columns(type, c);
            __m256i v[2][8];
            for (int r = 0; r < 8; ++r) {
                v[0][r] = v[1][r] = _mm256_setzero_si256();
                if (r >= here) continue;
                const __m256i q = integers_avx(type, base + r * row_bytes, at);
                if (bits == 8) {
                    v[0][r] = q;
                    continue;
                }
                v[0][r] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)),
                                           centred_by);
                v[1][r] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)),
                                           centred_by);
            }
            for (int h = 0; h < halves; ++h) {
                transpose8(v[h]);
                for (int k = 0; k < 8; ++k)
                    _mm256_store_si256((__m256i *)(pq + (c / per + 8 * h + k) * PANEL + r0),
                                       v[h][k]);
            }
        }
    }
}
#endif

#ifdef GEMM_VNNI
/* pack_int's integers, 16 rows at a time: one vector a row for every 64 columns (int8: two runs
 * of 32 bytes) or 32 (int16: a run's widened to int16), transposed in registers so that a dword
 * of the 16 rows is one aligned store. */
static void pack_dwords_avx512(int type, int bits, const uint8_t *panel_w, int64_t row_bytes,
                               int64_t cols, int valid, uint32_t *pq) {
    const int64_t span = bits == 8 ? 2 * BLOCK : BLOCK;
    const int per = per_dword(bits), centred_by = centred(type, bits) ? centre(type) : 0;
    for (int r0 = 0; r0 < PANEL; r0 += 16) {
        const int here = valid - r0 >= 16 ? 16 : valid - r0 > 0 ? valid - r0 : 0;
        const uint8_t *base = panel_w + r0 * row_bytes;
        for (int64_t c = 0; c < cols; c += span) {
            const int two = bits == 8 && c + BLOCK < cols;
            const columns_at at = columns(type, c), next = columns(type, c + BLOCK);
            __m512 v[16];
            for (int r = 0; r < 16; ++r) {
                __m512i q = _mm512_setzero_si512();
                if (r < here) {
                    const uint8_t *row = base + r * row_bytes;
                    const __m256i bytes = integers_avx(type, row, at);
                    if (bits == 16)
                        q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(bytes),
                                             _mm512_set1_epi16((short)centred_by));
                    else {
                        q = _mm512_castsi256_si512(bytes);
                        if (two) q = _mm512_inserti64x4(q, integers_avx(type, row, next), 1);
                    }
                }
                v[r] = _mm512_castsi512_ps(q);
            }
            transpose16(v);
            for (int k = 0; k < (bits == 8 && !two ? 8 : 16); ++k)
                _mm512_store_ps((float *)(pq + (c / per + k) * PANEL + r0), v[k]);
        }
    }
}
#endif

#ifdef GEMM_VNNI
/* pack_int's scales and offsets for a format of 32 weights a block, 16 rows at a time: a block's
 * leading half (its scale; Q4_1's min the half after it) of each row gathered in one dword. */
static void scales_avx512(int type, int signed_q, const uint8_t *panel_w, int64_t row_bytes,
                          int64_t cols, int valid, float *ps, float *pm) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)row_bytes));
    const __m512 offset_per_scale = _mm512_set1_ps(signed_q ? 0.0f : -(float)centre(type));
    for (int r0 = 0; r0 < PANEL; r0 += 16) {
        const int here = valid - r0 >= 16 ? 16 : valid - r0 > 0 ? valid - r0 : 0;
        const __mmask16 mask = (__mmask16)((1u << here) - 1);
        const uint8_t *base = panel_w + r0 * row_bytes;
        for (int64_t b = 0; b < cols / BLOCK; ++b) {
            const __m512i fields = _mm512_mask_i32gather_epi32(
                _mm512_setzero_si512(), mask, rows, base + b * block_bytes(type), 1);
            const __m512 s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(fields));
            const __m256i mins = _mm512_cvtepi32_epi16(_mm512_srli_epi32(fields, 16));
            const __m512 m =
                type == Q4_1 ? _mm512_cvtph_ps(mins) : _mm512_mul_ps(s, offset_per_scale);
            _mm512_store_ps(ps + b * PANEL + r0, s);
            _mm512_store_ps(pm + b * PANEL + r0, m);
        }
    }
}
#endif

/* Panel p's integers (`bits` the activations'), scales and offsets (see above); rows past the
 * matrix's end are zeros. The integers by `path`'s vector code (the portable code's for it). */
static void pack_int(int type, int bits, const uint8_t *w, int64_t rows, int64_t cols, int64_t p,
                     uint32_t *pq, float *ps, float *pm, int path) {
    const int64_t size = block_size(type), stride = block_bytes(type), group = group_size(type);
    const int64_t row_bytes = stored_row_bytes(type, cols), groups = size / group;
    const int valid = rows - p * PANEL < PANEL ? (int)(rows - p * PANEL) : PANEL;
    const int per = per_dword(bits), signed_q = centred(type, bits), vectors = path != INT_PORTABLE;
    const uint8_t *panel_w = w + p * PANEL * row_bytes;
#ifdef GEMM_VNNI
    if (path == INT_VNNI) {
        pack_dwords_avx512(type, bits, panel_w, row_bytes, cols, valid, pq);
        if (size == BLOCK) {
            scales_avx512(type, signed_q, panel_w, row_bytes, cols, valid, ps, pm);
            return;
        }
    }
#endif
#ifdef GEMM_AVX2
    if (path == INT_AVX2) pack_dwords_avx2(type, bits, panel_w, row_bytes, cols, valid, pq);
#endif
    (void)panel_w; /* unused where neither is compiled */
    if (valid < PANEL) {
        if (!vectors) memset(pq, 0, sizeof *pq * (size_t)(cols / per * PANEL));
        memset(ps, 0, sizeof *ps * (size_t)(cols / group * PANEL));
        memset(pm, 0, sizeof *pm * (size_t)(cols / group * PANEL));
    }
    uint8_t q[SUPER_BLOCK];
    float s[16], m[16];
    for (int r = 0; r < valid; ++r) {
        const uint8_t *row = w + (p * PANEL + r) * row_bytes;
        for (int64_t c = 0; c < cols; c += size, row += stride) {
            block_scales(type, row, s, m);
            for (int64_t g = 0; g < groups; ++g) {
                ps[(c / group + g) * PANEL + r] = s[g];
                pm[(c / group + g) * PANEL + r] = signed_q ? 0.0f : m[g];
            }
            if (vectors) continue;
            block_integers(type, row, q);
            for (int64_t k = 0; k < size / per; ++k) {
                uint32_t dword = 0;
                for (int j = 0; j < per; ++j) {
                    const int v = q[per * k + j] - (signed_q ? centre(type) : 0);
                    dword |= (uint32_t)(v & (bits == 8 ? 0xFF : 0xFFFF)) << (bits * j);
                }
                pq[(c / per + k) * PANEL + r] = dword;
            }
        }
    }
}

/* One block of 32 activations quantized to -top .. top (`levels`): its integers q (returned in
 * `q`), scale d (returned) and the sums of q over each group (`sums`, one or two). */
static inline float quantize_block(const float *x, int top, int64_t group, int32_t *q,
                                   int32_t *sums) {
#ifdef GEMM_VNNI
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
    float amax = 0.0f;
    for (int k = 0; k < BLOCK; ++k) amax = fmaxf(amax, fabsf(x[k]));
#endif
    const float d = amax / (float)top, id = d > 0.0f ? 1.0f / d : 0.0f;
#ifdef GEMM_VNNI /* the rounding mode's nearest, as lrintf's */
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm512_storeu_si512(q, qlo);
    _mm512_storeu_si512(q + 16, qhi);
    if (group == BLOCK)
        sums[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    else
        sums[0] = _mm512_reduce_add_epi32(qlo), sums[1] = _mm512_reduce_add_epi32(qhi);
#else
    for (int k = 0; k < BLOCK; ++k) q[k] = (int32_t)lrintf(x[k] * id);
    for (int64_t g = 0; g < BLOCK / group; ++g) {
        sums[g] = 0;
        for (int64_t k = 0; k < group; ++k) sums[g] += q[g * group + k];
    }
#endif
    return d;
}

/* x's rows [start, start + count) quantized per 32 to `bits`: xq (cols elements a row), xd (a
 * scale a block), xs (d times the sum of the group's quants, a group's) and xi (-centre times
 * that sum, the group's integer start; see above). */
static void quantize_rows(const float *x, int64_t start, int64_t count, int64_t cols,
                          int64_t group, int bits, int top, int centre, void *xq, float *xd,
                          float *xs, int32_t *xi) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
        const float *row = x + (start + i) * cols;
        for (int64_t c = 0; c < cols; c += BLOCK) {
            int32_t q[BLOCK], sums[2];
            const float d = quantize_block(row + c, top, group, q, sums);
            if (bits == 8)
                for (int k = 0; k < BLOCK; ++k) ((int8_t *)xq)[i * cols + c + k] = (int8_t)q[k];
            else
                for (int k = 0; k < BLOCK; ++k) ((int16_t *)xq)[i * cols + c + k] = (int16_t)q[k];
            xd[i * (cols / BLOCK) + c / BLOCK] = d;
            for (int64_t g = 0; g < BLOCK / group; ++g) {
                xs[i * (cols / group) + c / group + g] = d * (float)sums[g];
                xi[i * (cols / group) + c / group + g] = -centre * sums[g];
            }
        }
    }
}

/* The portable products: each output's groups in order, the integer sum then one or two fused
 * multiply-adds (the VNNI path's arithmetic lane by lane, so the two agree to the bit). */
static void panel_int_portable(int bits, int offsets, const void *xq, const float *xd,
                               const float *xs, const int32_t *xi, int64_t count, int64_t cols,
                               int64_t group, const uint32_t *pq, const float *ps,
                               const float *pm, int valid, float *out, int64_t ldo) {
    const int64_t groups = cols / group;
    const int per = per_dword(bits);
    for (int64_t i = 0; i < count; ++i) {
        for (int j = 0; j < valid; ++j) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; ++g) {
                int32_t sum = bits == 8 && !offsets ? xi[i * groups + g] : 0;
                for (int64_t k = g * group; k < (g + 1) * group; k += per) {
                    const uint32_t dword = pq[(k / per) * PANEL + j];
                    for (int b = 0; b < per; ++b) {
                        const int64_t at = i * cols + k + b;
                        const int32_t a =
                            bits == 8 ? ((const int8_t *)xq)[at] : ((const int16_t *)xq)[at];
                        const int32_t q = bits == 8 ? (int32_t)(uint8_t)(dword >> (8 * b))
                                                    : (int32_t)(int16_t)(dword >> (16 * b));
                        sum += q * a;
                    }
                }
                const float scale = ps[g * PANEL + j] * xd[i * (cols / BLOCK) + g * group / BLOCK];
                acc = fmaf((float)sum, scale, acc);
                if (offsets) acc = fmaf(pm[g * PANEL + j], xs[i * groups + g], acc);
            }
            out[i * ldo + j] = acc;
        }
    }
}

#ifdef GEMM_VNNI
/* An int8 group's integer sums as float32, exactly: they are within 2^22 of 0 (at most
 * 32 * 255 * 127), and such an integer added to the bits of 1.5 * 2^23 is that float plus it.
 * An integer add and a float subtract: vcvtdq2ps of 512 bits took longer than the vpdpbusd
 * beside it on Zen 4. */
static inline __m512 int8_sums_as_floats(__m512i sum) {
    const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 * 2^23 */
    return _mm512_sub_ps(
        _mm512_castsi512_ps(_mm512_add_epi32(sum, _mm512_castps_si512(magic))), magic);
}

/* `mr` (at most ROWS_VNNI) rows of x by the panel's 32 rows: per group, the integer sums in
 * 2 * mr vectors (a dword of weights a step: vpdpbusd for int8, vpdpwssd for int16), then scaled
 * into 2 * mr float32 vectors. */
static inline __attribute__((always_inline)) void rows_vnni(
    int bits, int offsets, int mr, const uint8_t *xq, const float *xd, const float *xs,
    const int32_t *xi, int64_t cols, int64_t group, const uint32_t *pq, const float *ps,
    const float *pm, __mmask16 mask0, __mmask16 mask1, float *out, int64_t ldo) {
    const int64_t groups = cols / group, blocks = cols / BLOCK;
    const int per = per_dword(bits), bytes = element_bytes(bits);
    __m512 acc[ROWS_VNNI][2];
#pragma GCC unroll 8
    for (int m = 0; m < mr; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i sum[ROWS_VNNI][2];
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) {
            const int32_t start = bits == 8 && !offsets ? xi[m * groups + g] : 0;
            sum[m][0] = sum[m][1] = _mm512_set1_epi32(start);
        }
        for (int64_t k = g * group; k < (g + 1) * group; k += per) {
            const __m512i b0 = _mm512_load_si512(pq + (k / per) * PANEL);
            const __m512i b1 = _mm512_load_si512(pq + (k / per) * PANEL + 16);
#pragma GCC unroll 8
            for (int m = 0; m < mr; ++m) {
                int32_t dword;
                memcpy(&dword, xq + (m * cols + k) * bytes, sizeof dword);
                const __m512i a = _mm512_set1_epi32(dword);
                if (bits == 8) {
                    sum[m][0] = _mm512_dpbusd_epi32(sum[m][0], b0, a);
                    sum[m][1] = _mm512_dpbusd_epi32(sum[m][1], b1, a);
                } else {
                    sum[m][0] = _mm512_dpwssd_epi32(sum[m][0], b0, a);
                    sum[m][1] = _mm512_dpwssd_epi32(sum[m][1], b1, a);
                }
            }
        }
        const __m512 s0 = _mm512_load_ps(ps + g * PANEL), s1 = _mm512_load_ps(ps + g * PANEL + 16);
        const __m512 m0 = _mm512_load_ps(pm + g * PANEL), m1 = _mm512_load_ps(pm + g * PANEL + 16);
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) {
            const __m512 d = _mm512_set1_ps(xd[m * blocks + g * group / BLOCK]);
            const __m512 t = _mm512_set1_ps(xs[m * groups + g]);
            const __m512 f0 = bits == 8 ? int8_sums_as_floats(sum[m][0])
                                        : _mm512_cvtepi32_ps(sum[m][0]);
            const __m512 f1 = bits == 8 ? int8_sums_as_floats(sum[m][1])
                                        : _mm512_cvtepi32_ps(sum[m][1]);
            acc[m][0] = _mm512_fmadd_ps(f0, _mm512_mul_ps(s0, d), acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(f1, _mm512_mul_ps(s1, d), acc[m][1]);
            if (offsets) {
                acc[m][0] = _mm512_fmadd_ps(m0, t, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(m1, t, acc[m][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mr; ++m) {
        _mm512_mask_storeu_ps(out + m * ldo, mask0, acc[m][0]);
        _mm512_mask_storeu_ps(out + m * ldo + 16, mask1, acc[m][1]);
    }
}

/* The chunk's rows by the panel, ROWS_VNNI at a time; `bits` and `offsets` constants where it is
 * inlined. */
static inline __attribute__((always_inline)) void panel_vnni_bits(
    int bits, int offsets, const uint8_t *xq, const float *xd, const float *xs, const int32_t *xi,
    int64_t count, int64_t cols, int64_t group, const uint32_t *pq, const float *ps,
    const float *pm, int valid, float *out, int64_t ldo) {
    const __mmask16 mask0 = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
    const __mmask16 mask1 =
        valid >= 32 ? 0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
    const int64_t blocks = cols / BLOCK, groups = cols / group, row = cols * element_bytes(bits);
    int64_t i = 0;
    for (; i + ROWS_VNNI <= count; i += ROWS_VNNI)
        rows_vnni(bits, offsets, ROWS_VNNI, xq + i * row, xd + i * blocks, xs + i * groups,
                  xi + i * groups, cols, group, pq, ps, pm, mask0, mask1, out + i * ldo, ldo);
    const uint8_t *a = xq + i * row;
    const float *d = xd + i * blocks, *t = xs + i * groups;
    const int32_t *u = xi + i * groups;
    float *o = out + i * ldo;
    switch (count - i) { /* the tail, its row count a constant in each case */
#define TAIL(n) \
    case n: \
        rows_vnni(bits, offsets, n, a, d, t, u, cols, group, pq, ps, pm, mask0, mask1, o, ldo); \
        break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5)
#undef TAIL
    default: break;
    }
}
#endif

#ifdef GEMM_AVX2
/* `mr` (at most ROWS_AVX2) rows of x by AVX2_VECTORS vectors of 8 of the panel's rows from
 * vector v0 on: per group, the integer sums (int8: vpmaddubsw's pairs of unsigned weight and
 * signed activation bytes, within int16 by `levels`, then vpmaddwd's by ones; int16: vpmaddwd),
 * then scaled into float32 vectors, the portable code's steps lane by lane. A part of the panel
 * a pass, so that the sums, weights and activations stay in AVX2's 16 registers. */
static inline __attribute__((always_inline)) void rows_avx2(
    int bits, int offsets, int mr, int v0, const uint8_t *xq, const float *xd, const float *xs,
    const int32_t *xi, int64_t cols, int64_t group, const uint32_t *pq, const float *ps,
    const float *pm, int valid, float *out, int64_t ldo) {
    const int64_t groups = cols / group, blocks = cols / BLOCK;
    const int per = per_dword(bits), bytes = element_bytes(bits);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS_AVX2][AVX2_VECTORS];
#pragma GCC unroll 8
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < AVX2_VECTORS; ++v) acc[m][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256i sum[ROWS_AVX2][AVX2_VECTORS];
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m)
            for (int v = 0; v < AVX2_VECTORS; ++v)
                sum[m][v] = _mm256_set1_epi32(bits == 8 && !offsets ? xi[m * groups + g] : 0);
        for (int64_t k = g * group; k < (g + 1) * group; k += per) {
            const uint32_t *at = pq + k / per * PANEL + 8 * v0;
            __m256i b[AVX2_VECTORS];
            for (int v = 0; v < AVX2_VECTORS; ++v)
                b[v] = _mm256_load_si256((const __m256i *)(at + 8 * v));
#pragma GCC unroll 8
            for (int m = 0; m < mr; ++m) {
                int32_t dword;
                memcpy(&dword, xq + (m * cols + k) * bytes, sizeof dword);
                const __m256i a = _mm256_set1_epi32(dword);
                for (int v = 0; v < AVX2_VECTORS; ++v) {
                    const __m256i pairs = bits == 8 ? _mm256_maddubs_epi16(b[v], a) : b[v];
                    sum[m][v] = _mm256_add_epi32(
                        sum[m][v], _mm256_madd_epi16(pairs, bits == 8 ? ones : a));
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) {
            const __m256 d = _mm256_set1_ps(xd[m * blocks + g * group / BLOCK]);
            const __m256 t = _mm256_set1_ps(xs[m * groups + g]);
            for (int v = 0; v < AVX2_VECTORS; ++v) {
                const int64_t at = g * PANEL + 8 * (v0 + v);
                const __m256 scale = _mm256_mul_ps(_mm256_load_ps(ps + at), d);
                acc[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][v]), scale, acc[m][v]);
                if (offsets) acc[m][v] = _mm256_fmadd_ps(_mm256_load_ps(pm + at), t, acc[m][v]);
            }
        }
    }
    for (int v = 0; v < AVX2_VECTORS; ++v) {
        const int first = 8 * (v0 + v);
        const int lanes = valid - first >= 8 ? 8 : valid - first > 0 ? valid - first : 0;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) _mm256_maskstore_ps(out + m * ldo + first, mask, acc[m][v]);
    }
}

/* The chunk's rows by the panel, ROWS_AVX2 at a time; `bits` and `offsets` constants where it is
 * inlined. */
static inline __attribute__((always_inline)) void panel_avx2_bits(
    int bits, int offsets, const uint8_t *xq, const float *xd, const float *xs, const int32_t *xi,
    int64_t count, int64_t cols, int64_t group, const uint32_t *pq, const float *ps,
    const float *pm, int valid, float *out, int64_t ldo) {
    const int64_t blocks = cols / BLOCK, groups = cols / group, row = cols * element_bytes(bits);
    for (int v0 = 0; v0 < PANEL / 8; v0 += AVX2_VECTORS) {
        int64_t i = 0;
        for (; i + ROWS_AVX2 <= count; i += ROWS_AVX2)
            rows_avx2(bits, offsets, ROWS_AVX2, v0, xq + i * row, xd + i * blocks,
                      xs + i * groups, xi + i * groups, cols, group, pq, ps, pm, valid,
                      out + i * ldo, ldo);
        const uint8_t *a = xq + i * row;
        const float *d = xd + i * blocks, *t = xs + i * groups;
        const int32_t *u = xi + i * groups;
        float *o = out + i * ldo;
        switch (count - i) { /* the tail, its row count a constant in each case */
#define TAIL(n) \
    case n: \
        rows_avx2(bits, offsets, n, v0, a, d, t, u, cols, group, pq, ps, pm, valid, o, ldo); \
        break;
            TAIL(1) TAIL(2)
#undef TAIL
        default: break;
        }
    }
}
#endif

/* The chunk's rows by the panel on `path`'s vector code, `bits` and `offsets` made constants of
 * its kernel; 0 where `path` has none here (the portable code's then). */
static int panel_int_vectors(int path, int bits, int offsets, const void *xq, const float *xd,
                             const float *xs, const int32_t *xi, int64_t count, int64_t cols,
                             int64_t group, const uint32_t *pq, const float *ps, const float *pm,
                             int valid, float *out, int64_t ldo) {
#define PANEL(kernel, b, o) \
    kernel(b, o, xq, xd, xs, xi, count, cols, group, pq, ps, pm, valid, out, ldo)
#define PANELS(kernel)            \
    if (bits == 8 && offsets)     \
        PANEL(kernel, 8, 1);      \
    else if (bits == 8)           \
        PANEL(kernel, 8, 0);      \
    else if (offsets)             \
        PANEL(kernel, 16, 1);     \
    else                          \
        PANEL(kernel, 16, 0);     \
    return 1;
#ifdef GEMM_VNNI
    if (path == INT_VNNI) { PANELS(panel_vnni_bits) }
#endif
#ifdef GEMM_AVX2
    if (path == INT_AVX2) { PANELS(panel_avx2_bits) }
#endif
#undef PANELS
#undef PANEL
    return 0;
}

/* Which integer paths were compiled here: bit INT_x set for each (the portable one always). */
int quant_gemm_int_paths(void) {
    int paths = 1 << INT_PORTABLE;
#ifdef GEMM_VNNI
    paths |= 1 << INT_VNNI;
#endif
#ifdef GEMM_AVX2
    paths |= 1 << INT_AVX2;
#endif
    return paths;
}

/* The largest integer quant_gemm_int quantizes activations to, for weights of `type`, `bits` and
 * `path` (see levels). */
int quant_gemm_int_levels(int type, int bits, int path) { return levels(type, bits, path); }

/* err[i] = || x_i - x'_i ||, the 2-norm of row i's quantization error (x' the activations that
 * quant_gemm_int multiplies for `type`, `bits` and `path`: each block's scale times its integers),
 * computed in double and rounded up. Returns 0, or -1 as quant_gemm_int does. */
int quant_gemm_int_error(int type, int bits, int path, const float *x, int64_t n, int64_t cols,
                         float *err) {
    if (!int_reads(type, cols, bits) || path < 0 || path > INT_AVX2) return -1;
    const int64_t group = group_size(type);
    for (int64_t i = 0; i < n; ++i) {
        double squares = 0.0;
        for (int64_t c = 0; c < cols; c += BLOCK) {
            int32_t q[BLOCK], sums[2];
            const float d =
                quantize_block(x + i * cols + c, levels(type, bits, path), group, q, sums);
            for (int k = 0; k < BLOCK; ++k) {
                const double e = (double)x[i * cols + c + k] - (double)d * q[k];
                squares += e * e;
            }
        }
        err[i] = (float)(sqrt(squares) * (1.0 + 0x1p-20));
    }
    return 0;
}

/* norms[r] = the 2-norm of row r's offsets as quant_gemm_int takes them for `bits` (each weight's
 * group offset m; 0 where the format has no offset terms), rounded up: the float32 roundings of
 * an output's two terms a group grow with them. Returns 0, or -1 as quant_gemm_int does. */
int quant_gemm_int_offset_norms(int type, int bits, const uint8_t *w, int64_t rows, int64_t cols,
                                float *norms) {
    if (!int_reads(type, cols, bits)) return -1;
    const int64_t size = block_size(type), group = group_size(type);
    const int64_t row_bytes = stored_row_bytes(type, cols);
    for (int64_t r = 0; r < rows; ++r) {
        double squares = 0.0;
        for (int64_t c = 0; c < cols && offset_terms(type); c += size) {
            float s[16], m[16];
            block_scales(type, w + r * row_bytes + c / size * block_bytes(type), s, m);
            for (int64_t g = 0; g < size / group; ++g) squares += (double)group * m[g] * m[g];
        }
        norms[r] = (float)(sqrt(squares) * (1.0 + 0x1p-20));
    }
    return 0;
}

/* out[n, rows] = x[n, cols] @ dequantized(w).T with x quantized per 32 to `bits` (8 or 16; see
 * above), by `path` (INT_x). Returns as quant_gemm does: 0; -1 for a type it does not read, cols
 * not a whole number of blocks, or bits not 8 or 16; -2 where its buffers cannot be allocated; -3
 * for a path not compiled. */
int quant_gemm_int(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                   int64_t n, int bits, int path, int num_threads, float *out) {
    if (!int_reads(type, cols, bits)) return -1;
    if (path < 0 || path > INT_AVX2 || !(quant_gemm_int_paths() & (1 << path))) return -3;
    if (n <= 0 || rows <= 0) return 0;
    const int64_t chunk = n < CHUNK ? n : CHUNK, group = group_size(type);
    const int64_t panels = (rows + PANEL - 1) / PANEL;
    const int per = per_dword(bits), offsets = offset_terms(type);
    const int64_t row_bytes = stored_row_bytes(type, cols);
    void *xq = aligned_alloc(64, (size_t)(chunk * cols * element_bytes(bits)));
    float *xd = aligned_alloc(64, sizeof *xd * (size_t)(chunk * (cols / BLOCK)));
    float *xs = aligned_alloc(64, sizeof *xs * (size_t)(chunk * (cols / group)));
    int32_t *xi = aligned_alloc(64, sizeof *xi * (size_t)(chunk * (cols / group)));
    int failed = !xq || !xd || !xs || !xi;
    if (failed) {
        free(xq), free(xd), free(xs), free(xi);
        return -2;
    }
#pragma omp parallel num_threads(num_threads)
    {
        uint32_t *pq = aligned_alloc(64, sizeof *pq * (size_t)(cols / per * PANEL));
        float *ps = aligned_alloc(64, sizeof *ps * (size_t)(cols / group * PANEL));
        float *pm = aligned_alloc(64, sizeof *pm * (size_t)(cols / group * PANEL));
        if (!pq || !ps || !pm) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t start = 0; start < n; start += chunk) {
            const int64_t count = n - start < chunk ? n - start : chunk;
            /* ends in a barrier */
            quantize_rows(x, start, count, cols, group, bits, levels(type, bits, path),
                          bits == 8 ? centre(type) : 0, xq, xd, xs, xi);
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) break;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                const int valid = rows - p * PANEL < PANEL ? (int)(rows - p * PANEL) : PANEL;
                float *o = out + start * rows + p * PANEL;
                pack_int(type, bits, w, rows, cols, p, pq, ps, pm, path);
                prefetch_panel(w, rows, row_bytes, p + 1);
                if (panel_int_vectors(path, bits, offsets, xq, xd, xs, xi, count, cols, group, pq,
                                      ps, pm, valid, o, rows))
                    continue;
                panel_int_portable(bits, offsets, xq, xd, xs, xi, count, cols, group, pq, ps, pm,
                                   valid, o, rows);
            } /* a barrier before the next chunk's quantization */
        }
        free(pq);
        free(ps);
        free(pm);
    }
    free(xq);
    free(xd);
    free(xs);
    free(xi);
    return failed ? -2 : 0;
}
