/* What cpu_attention.c offers the other C files of its library (decode_layer.c): the formats
 * its KV cache may be stored in, by the codes attention.py's C_FORMATS gives them, and its
 * entry. native.py hashes this header into the library's build digest. */
#ifndef PAGEDBATCH_CPU_ATTENTION_H
#define PAGEDBATCH_CPU_ATTENTION_H

#include <stdint.h>

enum kv_format { KV_FLOAT32 = 0, KV_INT8 = 1, KV_FP8 = 2, KV_BF16 = 3, KV_F16 = 4 };

int paged_decode_attention_kv(const float *query, const void *key_cache, const void *value_cache,
                              const float *key_scales, const float *value_scales, int format,
                              int64_t scale_group, const int32_t *block_tables, int64_t table_width,
                              const int64_t *token_rows, const int64_t *table_rows,
                              const int64_t *first_keys, const int64_t *seq_lens,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, float scale, int num_threads,
                              float *out);

#endif
