/* The library's functions that one source calls in another (hybridlm/lm/kernels/__init__.py
 * builds them together into one library). */
#ifndef HYBRIDLM_KERNELS_H
#define HYBRIDLM_KERNELS_H

#include <stdint.h>

/* One segment of a matrix stacked from rows of GGUF blocks (blockquant.c): `rows` rows of ggml
 * type `type`, `row_bytes` apart from `data` on. */
typedef struct {
    const uint8_t *data;
    int64_t type, rows, row_bytes;
} Segment;

int hybridlm_affine(const float *x, int64_t R, int64_t K, const float *wt, int64_t ldw, const float *b, int64_t N,
                    float *y);
int hybridlm_int4_affine(const float *x, int64_t R, int64_t K, const uint8_t *packed, const uint16_t *d,
                         const uint16_t *m, const float *b, int64_t N, float *y);
int hybridlm_blockquant_affine(const float *x, int64_t R, int64_t K, const Segment *segs, int64_t nseg,
                               const float *b, int64_t N, float *y);
int hybridlm_decode_attention_batch(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d,
                                    const int64_t *rows, int64_t layer, int64_t window, const float *cos,
                                    const float *sin, float scale, float *out, float *S, float *A);

int hybridlm_fork_attention(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d, const float *K,
                            const float *V, int64_t cap, int64_t n, int64_t start, const float *cos, const float *sin,
                            float scale, float *own_k, float *own_v, float *out);

#endif
