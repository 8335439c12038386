/* A Llama decoder layer for a decode step on quantized weights, in one call: on a step of a few
 * one-token sequences the layer's arithmetic is small, and the two dozen torch ops and Python
 * frames a layer takes otherwise cost as much as reading its weights (SmolLM2-135M, one
 * request: about half the step).
 *
 * The layer, for n tokens (rows of x), as models/llama.py's DecoderLayer computes it:
 *   r = x + residual (or x, for the first layer)           the residual stream, written back
 *   h = rms_norm(r) * norm1
 *   q, k, v = h @ qkv.T; q and k rotated by position (cpu_rotary.c, bitwise torch's formula)
 *   k and v written to the token's cache slot (float32, or rounded to the cache's float16 or
 *   bfloat16); q attends its sequence (cpu_attention.c)
 *   r = r + attention @ o.T; h = rms_norm(r) * norm2
 *   out = (silu(h @ gate.T) * (h @ up.T)) @ down.T
 * and as Gemma 3's (gemma3.py) with `gemma` set: each head's q and k normalised before rotary,
 * the attention's output normalised before it joins the residual stream and the MLP's output
 * too, GELU (tanh) in place of SiLU; its norms' vectors are their 1 + weight. q, k and v may be
 * in up to three runs of blocks of different formats (Gemma's v in Q8_0, q and k in Q5_0).
 * The matrix products are quant_matmul.c's streaming paths for a few tokens, and past the step's
 * `streamed_rows` quant_gemm.c's many-row product each linear's format takes (its `gemm`,
 * another library's function, whose address and settings decode_layer.py hands over:
 * quant_gemm's bf16 products or quant_gemm_int's integer ones), so that a decode step of many
 * sequences runs in one call a layer too, its token loops split among the threads. The norms,
 * SiLU and GELU are computed here in float32, their sums in another order than torch's: results
 * differ from the unfused layer's in the last bits, as quantization gguf's products already do
 * from exact mode's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_attention.h"
#include "quant_formats.h"

int quant_matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                       int64_t n, int num_threads, float *out);
int quant_matmul_int8(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                      int64_t n, int num_threads, float *out);
int quant_matmul_int16(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                       int64_t n, int num_threads, float *out);
int rotary_embedding(const int64_t *positions, int64_t num_tokens, const float *query,
                     int64_t q_stride, int64_t q_heads, const float *key, int64_t k_stride,
                     int64_t k_heads, int64_t head_dim, const float *cos_sin, int64_t rows,
                     int num_threads, float *q_out, float *k_out);

/* quant_gemm.c's quant_gemm (settings: path, passes) or quant_gemm_int (bits, path): out[n, rows]
 * = x @ w.T, both of this shape. */
typedef int (*many_rows_product)(int type, const uint8_t *w, int64_t rows, int64_t cols,
                                 const float *x, int64_t n, int setting1, int setting2,
                                 int num_threads, float *out);

/* A linear's weight in one run of blocks (quant_linear.QuantizedWeight). */
struct quant_linear {
    int32_t type;  /* ggml type */
    int32_t activations; /* 0 float32, 1 int8, 2 int16 (quant_linear.ACTIVATIONS) */
    const uint8_t *blocks;
    int64_t rows, cols;
    many_rows_product gemm; /* past the step's streamed rows (NULL: streamed whatever the rows) */
    int32_t gemm_settings[2];
};

enum { QKV_RUNS = 3 };

/* What a layer holds: fixed from load on (decode_layer.py builds it once). */
struct decode_layer {
    struct quant_linear qkv[QKV_RUNS]; /* their rows one after the other */
    int64_t qkv_runs;
    struct quant_linear o, gate_up, down;
    const float *norm1, *norm2;
    float eps, scale;
    int64_t heads, kv_heads, head_dim;
    const float *cos_sin;
    int64_t cos_sin_rows;
    void *key_cache, *value_cache; /* [blocks, block_size, kv_heads, head_dim] */
    int64_t block_size;
    int32_t gemma;
    int32_t cache_format; /* KV_FLOAT32, KV_BF16 or KV_F16 (cpu_attention.h) */
    const float *q_norm, *k_norm, *post_attention_norm, *post_mlp_norm; /* gemma's */
};

/* What a step gives every layer: its tokens' positions and cache slots, the decode rows of
 * attention.py's plan (sequence i's query is token token_rows[i]), and how its products run. */
struct decode_step {
    int64_t tokens;
    const int64_t *positions, *slots;
    const int32_t *tables;
    int64_t table_width;
    const int64_t *token_rows, *table_rows, *first_keys, *seq_lens;
    int64_t seqs;
    int32_t threads;
    int64_t streamed_rows; /* tokens up to which the products stream the blocks */
};

/* Tokens from which the layer's own loops (norms, activations, cache writes) are split among the
 * threads: fewer take less time than starting them. */
enum { PARALLEL_TOKENS = 16 };

static int matmul(const struct quant_linear *w, const float *x, int64_t n,
                  const struct decode_step *s, float *out) {
    if (w->gemm && n > s->streamed_rows) {
        const int status = w->gemm(w->type, w->blocks, w->rows, w->cols, x, n,
                                   w->gemm_settings[0], w->gemm_settings[1], s->threads, out);
        return status == -1 || status == -3 ? -3 : status; /* -1 is the rotary table's here */
    }
    int (*const kernels[])(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, int,
                           float *) = {quant_matmul_float, quant_matmul_int8, quant_matmul_int16};
    return kernels[w->activations](w->type, w->blocks, w->rows, w->cols, x, n, s->threads, out);
}

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of `size`. */
static void rms_norm_row(const float *x, const float *weight, int64_t size, float eps,
                         float *out) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < size; ++i) sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(sum / (float)size + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) out[i] = weight[i] * (x[i] * inverse);
}

/* q, k and v of n tokens, [n, qkv_size]: each run's rows into its columns. */
static int qkv_matmul(const struct decode_layer *l, const float *h, int64_t n,
                      const struct decode_step *s, int64_t qkv_size, float *part, float *qkv) {
    if (l->qkv_runs == 1) return matmul(&l->qkv[0], h, n, s, qkv);
    int64_t column = 0;
    for (int64_t j = 0; j < l->qkv_runs; column += l->qkv[j++].rows) {
        const int64_t rows = l->qkv[j].rows;
        const int status = matmul(&l->qkv[j], h, n, s, part);
        if (status) return status;
        for (int64_t t = 0; t < n; ++t)
            memcpy(qkv + t * qkv_size + column, part + t * rows, sizeof(float) * rows);
    }
    return 0;
}

/* GELU's tanh approximation, as torch's gelu(approximate="tanh"), times up: a[i] =
 * gelu(gate[i]) * up[i] for n values. 0.5 x (1 + tanh(u)) is x sigmoid(2u) = x / (1 + e^(-2u)):
 * one exponential and no cancellation where tanh(u) nears -1. With AVX-512 sixteen lanes a step,
 * e^t as 2^k 2^f (k = round(t log2 e), 2^f by a degree-6 polynomial on |f| <= 1/2, within two
 * ulps of expf): the tanhf of libm, a call a value, took 20 us a layer of Gemma 3 (2,048 values),
 * about 2% of a decode step. */
static inline float gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * inner));
}

#ifdef __AVX512F__
/* e^t lane by lane, t clamped to [-87, 88] (beyond, the GELU's sigmoid is 0 or 1 in float32). */
static inline __m512 exp_avx512(__m512 t) {
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* f ln 2 = t - k ln 2, ln 2 in two parts so that k ln 2's high part is exact */
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    /* e^r on |r| <= ln 2 / 2: Cephes expf's polynomial */
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}
#endif

static void gelu_tanh_and_mul(const float *gate, const float *up, int64_t n, float *a) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), cubic = _mm512_set1_ps(0.044715f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate + i);
        const __m512 inner = _mm512_mul_ps(
            c, _mm512_fmadd_ps(_mm512_mul_ps(cubic, x), _mm512_mul_ps(x, x), x));
        const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), inner));
        const __m512 g = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(g, _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) a[i] = gelu_tanh(gate[i]) * up[i];
}

/* SiLU times up: a[i] = gate[i] / (1 + e^-gate[i]) * up[i] for n values. */
static void silu_and_mul(const float *gate, const float *up, int64_t n, float *a) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* n floats from src stored at element `at` of a cache in `format`, rounded to nearest even
 * (float16 by F16C where the CPU has it; bfloat16 by quant_formats.h's to_bf16). */
static void store_row(void *cache, int64_t at, const float *src, int64_t n, int format) {
    if (format == KV_FLOAT32) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int64_t i = 0;
    if (format == KV_F16) {
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; ++i) {
            const _Float16 h = (_Float16)src[i];
            memcpy(dst + i, &h, sizeof h);
        }
        return;
    }
    for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

/* Returns 0; -1 where a position has no row in the rotary table, -2 where scratch or the
 * attention's scores could not be allocated. `out` may be `x`. */
int quant_decode_layer(const struct decode_layer *l, const struct decode_step *s, const float *x,
                       float *residual, int32_t has_residual, float *out) {
    const int64_t n = s->tokens, hidden = l->o.rows, inter = l->down.cols;
    const int64_t q_size = l->heads * l->head_dim, kv_size = l->kv_heads * l->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, threads = s->threads;
    float *scratch = malloc(sizeof(float) * (size_t)(n * (hidden + 2 * qkv_size + 2 * q_size +
                                                          kv_size + 3 * inter)));
    if (!scratch) return -2;
    float *h = scratch, *qkv = h + n * hidden, *q = qkv + n * qkv_size, *k = q + n * q_size;
    float *attn = k + n * kv_size, *gate_up = attn + n * q_size, *act = gate_up + n * 2 * inter;
    float *part = act + n * inter; /* a run of q, k, v where there are several */
    const int64_t head_dim = l->head_dim;
    const int split = n >= PARALLEL_TOKENS ? (int)threads : 1;
    int status = 0;

#pragma omp parallel for num_threads(split) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        float *r = residual + t * hidden;
        const float *xt = x + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) r[i] = has_residual ? xt[i] + r[i] : xt[i];
        rms_norm_row(r, l->norm1, hidden, l->eps, h + t * hidden);
    }
    if ((status = qkv_matmul(l, h, n, s, qkv_size, part, qkv))) goto done;
    if (l->gemma) /* each head of q and of k normalised over head_dim */
#pragma omp parallel for num_threads(split) schedule(static)
        for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < l->heads + l->kv_heads; ++j) {
                float *head = qkv + t * qkv_size + j * head_dim;
                rms_norm_row(head, j < l->heads ? l->q_norm : l->k_norm, head_dim, l->eps, head);
            }
    status = rotary_embedding(s->positions, n, qkv, qkv_size, l->heads, qkv + q_size, qkv_size,
                              l->kv_heads, l->head_dim, l->cos_sin, l->cos_sin_rows, split, q,
                              k);
    if (status) goto done;
#pragma omp parallel for num_threads(split) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = s->slots[t] * kv_size;
        store_row(l->key_cache, slot, k + t * kv_size, kv_size, l->cache_format);
        store_row(l->value_cache, slot, qkv + t * qkv_size + q_size + kv_size, kv_size,
                  l->cache_format);
    }
    if (paged_decode_attention_kv(q, l->key_cache, l->value_cache, NULL, NULL, l->cache_format,
                                  head_dim, s->tables, s->table_width, s->token_rows,
                                  s->table_rows, s->first_keys, s->seq_lens, s->seqs, l->heads,
                                  l->kv_heads, head_dim, l->block_size, l->scale, (int)threads,
                                  attn)) {
        status = -2;
        goto done;
    }
    float *o = h; /* h is read no more */
    if ((status = matmul(&l->o, attn, n, s, o))) goto done;
#pragma omp parallel for num_threads(split) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        float *r = residual + t * hidden, *ot = o + t * hidden;
        if (l->gemma) rms_norm_row(ot, l->post_attention_norm, hidden, l->eps, ot);
        for (int64_t i = 0; i < hidden; ++i) r[i] += ot[i];
        rms_norm_row(r, l->norm2, hidden, l->eps, h + t * hidden);
    }
    if ((status = matmul(&l->gate_up, h, n, s, gate_up))) goto done;
#pragma omp parallel for num_threads(split) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const float *gate = gate_up + t * 2 * inter, *up = gate + inter;
        float *a = act + t * inter;
        if (l->gemma)
            gelu_tanh_and_mul(gate, up, inter, a);
        else
            silu_and_mul(gate, up, inter, a);
    }
    if ((status = matmul(&l->down, act, n, s, out))) goto done;
    if (l->gemma)
#pragma omp parallel for num_threads(split) schedule(static)
        for (int64_t t = 0; t < n; ++t)
            rms_norm_row(out + t * hidden, l->post_mlp_norm, hidden, l->eps, out + t * hidden);
done:
    free(scratch);
    return status;
}
