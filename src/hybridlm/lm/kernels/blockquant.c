/* Affine maps on GGUF's block-quantised grids, read as the file stores them (see
 * hybridlm/lm/blockquant.py): a matrix is N rows of blocks, each row K / QK blocks of `bytes`
 * bytes, and every block holds units of 32 or 16 weights, each unit
 *
 *   Ŵ[o, k] = D_u · (c_k − z) + M_u         (k in unit u of row o; M_u = 0 where the type has no minimum)
 *
 * with c_k the stored code, z the type's zero (8 for Q4_0, 16 for Q5_0, 4 for Q3_K, 32 for Q6_K,
 * else 0; Q8_0's codes are signed bytes) and D_u, M_u float32 numbers formed from the block's half
 * floats and small integer scales exactly as gguf-py's and llama.cpp's dequantisers form them:
 *
 *   type  QK  bytes  unit  D_u                 M_u
 *   Q4_0  32   18     32   d                   0
 *   Q4_1  32   20     32   d                   m
 *   Q5_0  32   22     32   d                   0
 *   Q5_1  32   24     32   d                   m
 *   Q8_0  32   34     32   d                   0
 *   Q2_K 256   84     16   d · (sc & 15)       −(dmin · (sc >> 4))
 *   Q3_K 256  110     16   d · (sc6 − 32)      0
 *   Q4_K 256  144     32   d · sc6             −(dmin · m6)
 *   Q5_K 256  176     32   d · sc6             −(dmin · m6)
 *   Q6_K 256  210     16   d · sc8             0
 *
 * Every product D_u (c − z) is exact in float32 (at most 23 significant bits), so the
 * dequantiser below (hybridlm_blockquant_dequantise) gives gguf-py's bits: Ŵ = D_u (c − z),
 * or fl(D_u c + M_u) with one rounding where there is a minimum.
 *
 * The product. y[r, o] = Σ_k x[r, k] Ŵ[o, k] + b[o] takes the input in 16 bits per group of 32
 * (as int4.c does): x̂[r, k] = round(x[r, k] · (32767 / a)) ∈ {−32767, …, 32767} with
 * a = max_{k in g} |x[r, k]| and s[r, g] = a / 32767, and float32 sums X[r, u] = Σ_{k in u} x[r, k]
 * (in a fixed order, see `group`) for the minima. Per unit,
 *
 *   I[r, o, u] = Σ_{k in u} c_k x̂[r, k] − z Σ_{k in u} x̂[r, k]        (an exact integer, |I| < 2^31)
 *
 * and the units are taken eight at a time (an octet: 8 consecutive units of a row, the last one
 * padded with empty units): lane u of two accumulators of eight floats takes
 *
 *   acc_u ← fma(fl(D_u · s[r, g(u)]), float(I[r, o, u]), acc_u),   off_u ← fma(M_u, X[r, u], off_u)
 *
 * octet after octet, and y[r, o] = hsum(acc + off) + b[o] (simd.h's hsum: a fixed order of the
 * lanes). The integer sums are exact in any order, so every output is one fixed sequence of
 * float roundings whatever the rows beside it, the tiling of rows or the threads: the product is
 * batch-invariant (a row gets the same bits alone or in any batch). Against the float32 product
 * on Ŵ it differs by the input's rounding (|x̂ s − x| ≤ s/2) and by float32 accumulation, and by
 * at most half a unit in the last place of each Ŵ where there is a minimum (the unrounded
 * D_u c + M_u is what the sums see).
 *
 * A matrix may be a stack of row segments of different types (a fused W_qkv whose W_v is stored
 * on another grid): each segment is rows of its own blocks, and the product writes each
 * segment's outputs in their columns of y. Output rows are split in contiguous ranges over an
 * OpenMP team (PyTorch's own pool, see build.py); tiles of up to TILE rows of x share each
 * unpacked unit.
 *
 * The vector path unpacks the codes to 16-bit integers and forms I with 16-bit multiply-adds
 * (vpmaddwd, or AVX-512 VNNI's vpdpwssd on 256-bit vectors where the build has it, with
 * AVX-512BW masks for Q5's fifth bits: the same integers). Without AVX2, FMA and F16C the same
 * integers are formed by plain loops and the units' terms are added one by one,
 * acc ← acc + (D_u s)·I, off ← off + M_u X (separate multiply and add), y = (acc + off) + b:
 * another fixed order, as batch-invariant.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HYBRIDLM_VNNI 1
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

/* ggml's type numbers. */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { TILE = 4, AHEAD = 4, OCTET = 8 };

INLINE int64_t block_size(int64_t type) { return type >= Q2_K ? 256 : 32; }

INLINE int64_t block_bytes(int64_t type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

INLINE int unit_size(int64_t type) { return type == Q2_K || type == Q3_K || type == Q6_K ? 16 : 32; }

INLINE int zero_code(int64_t type) {
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q3_K ? 4 : type == Q6_K ? 32 : 0;
}

INLINE int has_minimum(int64_t type) {
    return type == Q4_1 || type == Q5_1 || type == Q2_K || type == Q4_K || type == Q5_K;
}

/* Whether the library reads `type`, and its block's weights and bytes (for the Python side). */
int hybridlm_blockquant_type(int64_t type, int64_t *weights, int64_t *bytes) {
    if (type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q5_1 && type != Q8_0 && (type < Q2_K || type > Q6_K))
        return 0;
    *weights = block_size(type), *bytes = block_bytes(type);
    return 1;
}

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 6-bit scales (sc) and minima (m) of the eight units of a Q4_K or Q5_K block, one byte each
 * (unit j in byte j), from its 12 packed bytes: the low six bits of bytes 0–3 and 4–7 for units
 * 0–3, and for units 4–7 the nibbles of bytes 8–11 with the top two bits of bytes 0–7 above them. */
INLINE void scales_mins(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    const uint32_t a = u32(q), b = u32(q + 4), c = u32(q + 8), six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
    *sc = (uint64_t)((c & four) | ((a >> 6) & two) << 4) << 32 | (a & six);
    *m = (uint64_t)(((c >> 4) & four) | ((b >> 6) & two) << 4) << 32 | (b & six);
}

/* The 6-bit scales (before − 32) of units 8h … 8h + 7 of a Q3_K block, one byte each: the
 * nibbles of bytes 0–7 (low ones for units 0–7, high for 8–15), two bits of bytes 8–11 above. */
INLINE uint64_t scales3(const uint8_t *q, int h) {
    const uint64_t low = (h ? u32(q) >> 4 | (uint64_t)(u32(q + 4) >> 4) << 32 : u32(q) | (uint64_t)u32(q + 4) << 32);
    const uint32_t c = u32(q + 8) >> (4 * h), two = 0x03030303;
    const uint64_t high = (uint64_t)((c >> 2) & two) << 32 | (c & two);
    return (low & 0x0F0F0F0F0F0F0F0FULL) | high << 4;
}

/* D_u and M_u of unit u of the block at p. */
static void unit_scale(int64_t type, const uint8_t *p, int u, float *D, float *M) {
    *M = 0.f;
    switch (type) {
    case Q4_0: case Q5_0: case Q8_0: *D = half_to_float(u16(p)); break;
    case Q4_1: case Q5_1: *D = half_to_float(u16(p)), *M = half_to_float(u16(p + 2)); break;
    case Q2_K:
        *D = half_to_float(u16(p + 80)) * (float)(p[u] & 15);
        *M = -(half_to_float(u16(p + 82)) * (float)(p[u] >> 4));
        break;
    case Q3_K: *D = half_to_float(u16(p + 108)) * (float)((int)(scales3(p + 96, u >> 3) >> (8 * (u & 7)) & 0xFF) - 32); break;
    case Q4_K: case Q5_K: {
        uint64_t sc, m;
        scales_mins(p + 4, &sc, &m);
        *D = half_to_float(u16(p)) * (float)(sc >> (8 * u) & 0xFF);
        *M = -(half_to_float(u16(p + 2)) * (float)(m >> (8 * u) & 0xFF));
        break;
    }
    default: *D = half_to_float(u16(p + 208)) * (float)(int8_t)p[192 + u]; /* Q6_K */
    }
}

/* The codes c of unit u of the block at p (32 or 16 of them). */
static void unit_codes(int64_t type, const uint8_t *p, int u, int c[32]) {
    const int h = u >> 3, s = (u & 7) >> 1, i0 = 16 * (u & 1); /* units of 16: element 128h + 32s + i0 + j */
    switch (type) {
    case Q4_0: case Q4_1: {
        const uint8_t *qs = p + (type == Q4_0 ? 2 : 4);
        for (int j = 0; j < 16; ++j) c[j] = qs[j] & 15, c[j + 16] = qs[j] >> 4;
        break;
    }
    case Q5_0: case Q5_1: {
        const uint8_t *hp = p + (type == Q5_0 ? 2 : 4), *qs = hp + 4;
        const uint32_t qh = u32(hp);
        for (int j = 0; j < 16; ++j)
            c[j] = (qs[j] & 15) | (int)((qh >> j) & 1) << 4, c[j + 16] = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        break;
    }
    case Q8_0:
        for (int j = 0; j < 32; ++j) c[j] = (int8_t)p[2 + j];
        break;
    case Q2_K:
        for (int j = 0; j < 16; ++j) c[j] = (p[16 + 32 * h + i0 + j] >> (2 * s)) & 3;
        break;
    case Q3_K:
        for (int j = 0; j < 16; ++j)
            c[j] = ((p[32 + 32 * h + i0 + j] >> (2 * s)) & 3) | ((p[i0 + j] >> (4 * h + s)) & 1) << 2;
        break;
    case Q4_K: case Q5_K: {
        const uint8_t *qs = p + (type == Q4_K ? 16 : 48) + 32 * (u >> 1);
        for (int j = 0; j < 32; ++j)
            c[j] = ((qs[j] >> (4 * (u & 1))) & 15) | (type == Q5_K ? ((p[16 + j] >> u) & 1) << 4 : 0);
        break;
    }
    default: /* Q6_K */
        for (int j = 0; j < 16; ++j)
            c[j] = ((p[64 * h + 32 * (s & 1) + i0 + j] >> (4 * (s >> 1))) & 15)
                 | ((p[128 + 32 * h + i0 + j] >> (2 * s)) & 3) << 4;
    }
}

/* Row o of one segment's Ŵ into w [K]: gguf-py's bits. */
static void dequantise_row(const Segment *seg, int64_t K, int64_t o, float *w) {
    const int64_t type = seg->type, QK = block_size(type), bytes = block_bytes(type), n = unit_size(type);
    const int z = zero_code(type), minimum = has_minimum(type);
    const uint8_t *row = seg->data + o * seg->row_bytes;
    for (int64_t blk = 0; blk < K / QK; ++blk)
        for (int u = 0; u < QK / n; ++u) {
            int c[32];
            float D, M;
            const uint8_t *p = row + blk * bytes;
            unit_codes(type, p, u, c);
            unit_scale(type, p, u, &D, &M);
            float *out = w + blk * QK + u * n;
            for (int j = 0; j < n; ++j) out[j] = minimum ? D * (float)(c[j] - z) + M : D * (float)(c[j] - z);
        }
}

/* Ŵ[o, k] for the rows o0 ≤ o < o1 of one segment, into w [o1 − o0, K]. */
void hybridlm_blockquant_dequantise(const Segment *seg, int64_t K, int64_t o0, int64_t o1, float *w) {
#pragma omp parallel for schedule(static) if ((o1 - o0) * K > 65536)
    for (int64_t o = o0; o < o1; ++o) dequantise_row(seg, K, o, w + (o - o0) * K);
}

/* The rows ids[0 … n − 1] of one segment's Ŵ into w [n, K] (an embedding's lookups). */
void hybridlm_blockquant_rows(const Segment *seg, int64_t K, const int64_t *ids, int64_t n, float *w) {
#pragma omp parallel for schedule(static) if (n * K > 65536)
    for (int64_t i = 0; i < n; ++i) dequantise_row(seg, K, ids[i], w + i * K);
}

/* The input of one product: x̂ [R, K] and, per row, tables of the groups of 32 (s, X, Σ x̂) and of
 * the units of 16 (the same), each padded with zeros to whole octets. */
typedef struct {
    int64_t K, G, U; /* the tables' row lengths: groups of 32 and units of 16, rounded up to octets */
    int16_t *xq;
    float *s32, *X32, *s16, *X16;
    int32_t *H32, *H16;
} Input;

static int64_t up8(int64_t n) { return (n + OCTET - 1) / OCTET * OCTET; }

/* Σ of eight floats t in simd.h's hsum order: ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)). */
static inline float sum8(const float t[8]) {
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* One group of 32 entries xg of a row: x̂ into q, and s, the sums X of its halves of 16 (each
 * Σ_{i<8} (x_i + x_{8+i}) in sum8's order) and the sums H of x̂ over its halves. A group holding a
 * NaN or an infinity gets s = NaN (and x̂ = 0), so its outputs are NaN as the float product's are. */
static void group(const float *xg, int16_t *q, float *s, float X[2], int32_t H[2]) {
#ifdef HYBRIDLM_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
    __m256 v[4], a = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        const __m256 m = _mm256_andnot_ps(sign, v[i]);
        a = _mm256_max_ps(a, m), bad = _mm256_or_ps(bad, _mm256_cmp_ps(m, inf, _CMP_NLT_UQ));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const int finite = !_mm256_movemask_ps(bad);
    const __m256 inv = _mm256_set1_ps(finite && amax > 0.f ? 32767.f / amax : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    for (int i = 0; i < 2; ++i) {
        _mm256_storeu_si256((__m256i *)(q + 16 * i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * i], c[2 * i + 1]), 0xD8));
        const __m256i hs = _mm256_add_epi32(c[2 * i], c[2 * i + 1]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        H[i] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
        X[i] = hsum(_mm256_add_ps(v[2 * i], v[2 * i + 1]));
    }
#else
    float amax = 0.f;
    int finite = 1;
    for (int j = 0; j < 32; ++j) {
        const float m = fabsf(xg[j]);
        finite &= m < INFINITY; /* (false for a NaN too) */
        amax = m > amax ? m : amax;
    }
    const float inv = finite && amax > 0.f ? 32767.f / amax : 0.f;
    for (int i = 0; i < 2; ++i) {
        float t[8];
        H[i] = 0;
        for (int j = 0; j < 16; ++j) q[16 * i + j] = (int16_t)lrintf(xg[16 * i + j] * inv), H[i] += q[16 * i + j];
        for (int j = 0; j < 8; ++j) t[j] = xg[16 * i + j] + xg[16 * i + 8 + j];
        X[i] = sum8(t);
    }
#endif
    *s = finite ? amax / 32767.f : NAN;
}

/* x̂ and the tables of every group of every row of x [R, K]; X over a group of 32 is the sum of
 * its halves' (X₀ + X₁). */
static int prepare(const float *x, int64_t R, int64_t K, Input *in) {
    const int64_t G = up8(K / 32), U = up8(K / 16);
    char *mem = calloc(1, 2 * (size_t)(R * K) + (size_t)R * (size_t)(3 * G + 3 * U) * 4 + 64);
    if (!mem) return -1;
    in->K = K, in->G = G, in->U = U;
    in->xq = (int16_t *)mem;
    float *f = (float *)(mem + ((2 * (size_t)(R * K) + 63) / 64) * 64);
    in->s32 = f, in->X32 = f + R * G, in->s16 = f + 2 * R * G, in->X16 = f + 2 * R * G + R * U;
    in->H32 = (int32_t *)(f + 2 * R * G + 2 * R * U), in->H16 = in->H32 + R * G;
#pragma omp parallel for schedule(static) if (R * K > 65536)
    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < K / 32; ++g) {
            const int64_t i = r * G + g, j = r * U + 2 * g;
            float scale;
            group(x + r * K + 32 * g, in->xq + r * K + 32 * g, &scale, in->X16 + j, in->H16 + j);
            in->s32[i] = in->s16[j] = in->s16[j + 1] = scale;
            in->X32[i] = in->X16[j] + in->X16[j + 1], in->H32[i] = in->H16[j] + in->H16[j + 1];
        }
    return 0;
}

/* The tables of the units of `type`, row r, from unit U0 on. */
INLINE const float *scales_of(int64_t type, const Input *in, int64_t r) {
    return unit_size(type) == 32 ? in->s32 + r * in->G : in->s16 + r * in->U;
}
INLINE const float *sums_of(int64_t type, const Input *in, int64_t r) {
    return unit_size(type) == 32 ? in->X32 + r * in->G : in->X16 + r * in->U;
}
INLINE const int32_t *code_sums_of(int64_t type, const Input *in, int64_t r) {
    return unit_size(type) == 32 ? in->H32 + r * in->G : in->H16 + r * in->U;
}

/* Unit U of a row (counted along the row): its block, and its index inside the block. */
INLINE const uint8_t *unit_block(int64_t type, const uint8_t *row, int64_t U, int *u) {
    const int64_t per = block_size(type) / unit_size(type);
    *u = (int)(U % per);
    return row + (U / per) * block_bytes(type);
}

#ifdef HYBRIDLM_AVX2
/* 16 bytes at p as 16-bit integers. */
INLINE __m256i widen(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

/* acc + Σ pairs of c ⊙ x (16-bit codes against 16 entries of x̂), as eight 32-bit sums. */
INLINE __m256i dot16(__m256i acc, __m256i c, const int16_t *x) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)x);
#ifdef HYBRIDLM_VNNI
    return _mm256_dpwssd_epi32(acc, c, v);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(c, v));
#endif
}

INLINE __m256i shift_right(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
INLINE __m256i shift_left(__m256i v, int n) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(n)); }

/* 16 where bit j of `bits` is set, in 16-bit lane j, else 0 (to or into 4-bit codes). */
INLINE __m256i fifth_bits(uint32_t bits, __m256i c) {
#ifdef HYBRIDLM_VNNI
    return _mm256_mask_add_epi16(c, (__mmask16)bits, c, _mm256_set1_epi16(16));
#else
    const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           (short)0x8000);
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), lane), lane);
    return _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi16(16)));
#endif
}

/* The codes of unit u of the block at p as 16-bit integers: elements 0–15 in *a and 16–31 in *b
 * (units of 32), or 0–15 in *a (units of 16). */
INLINE void codes(int64_t type, const uint8_t *p, int u, __m256i *a, __m256i *b) {
    const __m256i nibble = _mm256_set1_epi16(15);
    const int h = u >> 3, s = (u & 7) >> 1, i0 = 16 * (u & 1);
    switch (type) {
    case Q4_0: case Q4_1: {
        const __m256i v = widen(p + (type == Q4_0 ? 2 : 4));
        *a = _mm256_and_si256(v, nibble), *b = _mm256_srli_epi16(v, 4);
        break;
    }
    case Q5_0: case Q5_1: {
        const uint8_t *hp = p + (type == Q5_0 ? 2 : 4);
        const uint32_t qh = u32(hp);
        const __m256i v = widen(hp + 4);
        *a = fifth_bits(qh & 0xFFFF, _mm256_and_si256(v, nibble));
        *b = fifth_bits(qh >> 16, _mm256_srli_epi16(v, 4));
        break;
    }
    case Q8_0:
        *a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 2)));
        *b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 18)));
        break;
    case Q2_K: *a = _mm256_and_si256(shift_right(widen(p + 16 + 32 * h + i0), 2 * s), _mm256_set1_epi16(3)); break;
    case Q3_K: {
        const __m256i low = _mm256_and_si256(shift_right(widen(p + 32 + 32 * h + i0), 2 * s), _mm256_set1_epi16(3));
        const __m256i high = _mm256_and_si256(shift_right(widen(p + i0), 4 * h + s), _mm256_set1_epi16(1));
        *a = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
        break;
    }
    case Q4_K: case Q5_K: {
        const uint8_t *qs = p + (type == Q4_K ? 16 : 48) + 32 * (u >> 1);
        __m256i x = widen(qs), y = widen(qs + 16);
        if (u & 1)
            x = _mm256_srli_epi16(x, 4), y = _mm256_srli_epi16(y, 4);
        else
            x = _mm256_and_si256(x, nibble), y = _mm256_and_si256(y, nibble);
        if (type == Q5_K) {
            const __m256i bit = _mm256_set1_epi16(16);
            const __m256i hx = widen(p + 16), hy = widen(p + 32);
            x = _mm256_or_si256(x, _mm256_and_si256(u <= 4 ? shift_left(hx, 4 - u) : shift_right(hx, u - 4), bit));
            y = _mm256_or_si256(y, _mm256_and_si256(u <= 4 ? shift_left(hy, 4 - u) : shift_right(hy, u - 4), bit));
        }
        *a = x, *b = y;
        break;
    }
    default: { /* Q6_K */
        __m256i low = widen(p + 64 * h + 32 * (s & 1) + i0);
        low = s >> 1 ? _mm256_srli_epi16(low, 4) : _mm256_and_si256(low, nibble);
        const __m256i hq = widen(p + 128 + 32 * h + i0);
        const __m256i high = _mm256_and_si256(s < 2 ? shift_left(hq, 4 - 2 * s) : shift_right(hq, 2 * s - 4),
                                              _mm256_set1_epi16(0x30));
        *a = _mm256_or_si256(low, high);
    }
    }
}

/* Σ c x̂ of one unit (its codes unpacked) against x̂ at x, as eight 32-bit sums. */
INLINE __m256i unit_dot(int64_t type, __m256i a, __m256i b, const int16_t *x) {
    const __m256i acc = dot16(_mm256_setzero_si256(), a, x);
    return unit_size(type) == 32 ? dot16(acc, b, x + 16) : acc;
}

/* The eight units' sums t[u] (eight partial sums each) as one vector, lane u: Σ of t[u]. */
INLINE __m256i reduce8(const __m256i t[OCTET]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The half floats at p, p + step, … as floats (n ≤ 8 of them, zeros after); eight are gathered
 * in registers (stored and loaded, a vector waits for the stores to drain). */
INLINE __m256 halves(const uint8_t *p, int64_t step, int n) {
    if (n == OCTET)
        return _mm256_cvtph_ps(_mm_setr_epi16(u16(p), u16(p + step), u16(p + 2 * step), u16(p + 3 * step),
                                              u16(p + 4 * step), u16(p + 5 * step), u16(p + 6 * step), u16(p + 7 * step)));
    uint16_t h[OCTET] = {0}; /* (a row's last octet: stored, then loaded) */
    for (int u = 0; u < n; ++u) h[u] = u16(p + u * step);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* D and M of an octet's units: units u0 … u0 + 7 of the block at p (K types), or unit 0 of the
 * n ≤ 8 blocks from p on (blocks of 32), lane by lane (0 beyond n). */
INLINE void octet_scales(int64_t type, const uint8_t *p, int u0, int n, __m256 *D, __m256 *M) {
    switch (type) {
    case Q4_0: case Q5_0: case Q8_0:
        *D = halves(p, block_bytes(type), n), *M = _mm256_setzero_ps();
        break;
    case Q4_1: case Q5_1:
        *D = halves(p, block_bytes(type), n), *M = halves(p + 2, block_bytes(type), n);
        break;
    case Q2_K: {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + u0)));
        *D = _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p + 80))),
                           _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
        *M = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p + 82))),
                                                              _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4))));
        break;
    }
    case Q3_K: {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales3(p + 96, u0 >> 3)));
        *D = _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p + 108))),
                           _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32))));
        *M = _mm256_setzero_ps();
        break;
    }
    case Q4_K: case Q5_K: {
        uint64_t sc, m;
        scales_mins(p + 4, &sc, &m);
        *D = _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p))),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
        *M = _mm256_sub_ps(_mm256_setzero_ps(),
                           _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p + 2))),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m)))));
        break;
    }
    default: /* Q6_K */
        *D = _mm256_mul_ps(_mm256_set1_ps(half_to_float(u16(p + 208))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + u0)))));
        *M = _mm256_setzero_ps();
    }
}

/* The float arithmetic of one octet for one row of x: the one place where a row's roundings
 * happen, so a row gets the same bits alone or in a tile. */
INLINE void octet_sum(int64_t type, const __m256i t[OCTET], __m256 D, __m256 M, const Input *in, int64_t r,
                      int64_t U0, __m256 *acc, __m256 *off) {
    __m256i sums = reduce8(t);
    const int z = zero_code(type);
    if (z) /* (z a power of two) */
        sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(code_sums_of(type, in, r) + U0)),
                                                        z == 4 ? 2 : z == 8 ? 3 : z == 16 ? 4 : 5));
    const __m256 ds = _mm256_mul_ps(D, _mm256_loadu_ps(scales_of(type, in, r) + U0));
    *acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(sums), *acc);
    if (has_minimum(type)) *off = _mm256_fmadd_ps(M, _mm256_loadu_ps(sums_of(type, in, r) + U0), *off);
}

/* One octet of one output row for the rows r0 … r0 + tile − 1 of x: units u0 … u0 + 7 of the
 * block at p (K types), or the n ≤ 8 blocks from p on (blocks of 32); U0 is the octet's first unit
 * along the row. A single row unpacks each unit as it goes; a tile unpacks the octet's units
 * once for all its rows. u0, n and tile are constants at every call (the shifts become immediates). */
INLINE void octet(int64_t type, int tile, const uint8_t *p, int u0, int n, const Input *in, int64_t r0, int64_t U0,
                  __m256 acc[], __m256 off[]) {
    const int n16 = unit_size(type);
    const int64_t step = block_size(type) == 32 ? block_bytes(type) : 0;
    __m256 D, M;
    octet_scales(type, p, u0, n, &D, &M);
    __m256i ca[OCTET], cb[OCTET], t8[OCTET];
    if (tile > 1)
        for (int u = 0; u < n; ++u) codes(type, p + u * step, step ? 0 : u0 + u, &ca[u], &cb[u]);
    for (int t = 0; t < tile; ++t) {
        const int16_t *x = in->xq + (r0 + t) * in->K + U0 * n16;
        for (int u = 0; u < OCTET; ++u) {
            if (u >= n) {
                t8[u] = _mm256_setzero_si256();
                continue;
            }
            if (tile == 1) codes(type, p + u * step, step ? 0 : u0 + u, &ca[u], &cb[u]);
            t8[u] = unit_dot(type, ca[u], cb[u], x + u * n16);
        }
        octet_sum(type, t8, D, M, in, r0 + t, U0, &acc[t], &off[t]);
    }
}

/* y[t · ldy] for the rows r0 … r0 + tile − 1 of x and one output row (its blocks `row`), octet
 * after octet along the row. */
INLINE void tile_row(int64_t type, int tile, const uint8_t *row, const Input *in, int64_t r0, float *y, int64_t ldy,
                     float bias) {
    const int64_t bytes = block_bytes(type), blocks = in->K / block_size(type);
    __m256 acc[TILE], off[TILE];
    for (int t = 0; t < tile; ++t) acc[t] = off[t] = _mm256_setzero_ps();
    if (block_size(type) == 32) {
        int64_t b = 0;
        for (; b + OCTET <= blocks; b += OCTET) octet(type, tile, row + b * bytes, 0, OCTET, in, r0, b, acc, off);
        if (b < blocks) /* the last, partial octet: n at run time (a block's one unit needs no constant) */
            octet(type, tile, row + b * bytes, 0, (int)(blocks - b), in, r0, b, acc, off);
    } else if (unit_size(type) == 32) {
        for (int64_t b = 0; b < blocks; ++b) octet(type, tile, row + b * bytes, 0, OCTET, in, r0, 8 * b, acc, off);
    } else {
        for (int64_t b = 0; b < blocks; ++b) {
            octet(type, tile, row + b * bytes, 0, OCTET, in, r0, 16 * b, acc, off);
            octet(type, tile, row + b * bytes, 8, OCTET, in, r0, 16 * b + 8, acc, off);
        }
    }
    for (int t = 0; t < tile; ++t) y[t * ldy] = hsum(_mm256_add_ps(acc[t], off[t])) + bias;
}

/* Ask for a row's blocks ahead of their use (one thread's rows lie one after another). */
INLINE void fetch(const uint8_t *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(p + line), _MM_HINT_T0);
}
#else
/* The plain loops: unit after unit, acc ← acc + (D s)·I and off ← off + M·X. */
static void tile_row(int64_t type, int tile, const uint8_t *row, const Input *in, int64_t r0, float *y, int64_t ldy,
                     float bias) {
    const int n16 = unit_size(type), z = zero_code(type);
    const int64_t units = in->K / n16;
    float acc[TILE] = {0.f}, off[TILE] = {0.f};
    for (int64_t U = 0; U < units; ++U) {
        int k, c[32];
        float D, M;
        const uint8_t *p = unit_block(type, row, U, &k);
        unit_codes(type, p, k, c);
        unit_scale(type, p, k, &D, &M);
        for (int t = 0; t < tile; ++t) {
            const int64_t r = r0 + t;
            const int16_t *x = in->xq + r * in->K + U * n16;
            int32_t I = 0;
            for (int j = 0; j < n16; ++j) I += c[j] * x[j];
            I -= z * code_sums_of(type, in, r)[U];
            acc[t] += D * scales_of(type, in, r)[U] * (float)I;
            off[t] += M * sums_of(type, in, r)[U];
        }
    }
    for (int t = 0; t < tile; ++t) y[t * ldy] = acc[t] + off[t] + bias;
}

static inline void fetch(const uint8_t *p, int64_t bytes) { (void)p, (void)bytes; }
#endif

/* Output rows o0 ≤ o < o1 of one segment (its first output is column `col` of y). */
INLINE void segment_rows(int64_t type, const Segment *seg, const Input *in, int64_t R, int64_t o0, int64_t o1,
                         const float *b, int64_t col, float *y, int64_t N) {
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = seg->data + o * seg->row_bytes;
        if (o + AHEAD < o1) fetch(row + AHEAD * seg->row_bytes, seg->row_bytes);
        const float bias = b ? b[col + o] : 0.f;
        int64_t r = 0; /* tiles of 4 rows, then 2, then 1 (three kernels per type, not four) */
        for (; r + TILE <= R; r += TILE) tile_row(type, TILE, row, in, r, y + r * N + col + o, N, bias);
        if (r + 2 <= R) tile_row(type, 2, row, in, r, y + r * N + col + o, N, bias), r += 2;
        if (r < R) tile_row(type, 1, row, in, r, y + r * N + col + o, N, bias);
    }
}

/* The same, the type a constant in each call (the unpacking specialised per type). */
static void rows_of(const Segment *seg, const Input *in, int64_t R, int64_t o0, int64_t o1, const float *b,
                    int64_t col, float *y, int64_t N) {
    switch (seg->type) {
    case Q4_0: segment_rows(Q4_0, seg, in, R, o0, o1, b, col, y, N); break;
    case Q4_1: segment_rows(Q4_1, seg, in, R, o0, o1, b, col, y, N); break;
    case Q5_0: segment_rows(Q5_0, seg, in, R, o0, o1, b, col, y, N); break;
    case Q5_1: segment_rows(Q5_1, seg, in, R, o0, o1, b, col, y, N); break;
    case Q8_0: segment_rows(Q8_0, seg, in, R, o0, o1, b, col, y, N); break;
    case Q2_K: segment_rows(Q2_K, seg, in, R, o0, o1, b, col, y, N); break;
    case Q3_K: segment_rows(Q3_K, seg, in, R, o0, o1, b, col, y, N); break;
    case Q4_K: segment_rows(Q4_K, seg, in, R, o0, o1, b, col, y, N); break;
    case Q5_K: segment_rows(Q5_K, seg, in, R, o0, o1, b, col, y, N); break;
    case Q6_K: segment_rows(Q6_K, seg, in, R, o0, o1, b, col, y, N); break;
    }
}

#ifdef HYBRIDLM_VNNI
/* The product of many rows (a prefill), AVX-512 VNNI: the integers I of the units as above, formed
 * with 512-bit multiply-adds across output channels instead of along the row. A tile of NR outputs
 * of a segment is unpacked once into 16-bit pairs of codes (c − z) (pairs[u][p][j]: codes 2p and
 * 2p + 1 of unit u of output j), then MR rows of x at a time take the whole tile, lane j of two
 * vectors per row holding output j:
 *
 *   acc_j ← fma(fl(D_u · s[r, g(u)]), float(I[r, o_j, u]), acc_j),   off_j ← fma(M_u, X[r, u], off_j)
 *
 * unit after unit, and y = (acc + off) + b: each output one fixed sequence of roundings (a row's
 * bits do not depend on the other rows), another order than the token step's. */
enum { NR = 32, MR = 4 };

static void pack_tile(int64_t type, const Segment *seg, int64_t K, int64_t o0, int nt, int32_t *pairs, float *D,
                      float *M) {
    const int n16 = unit_size(type), P = n16 / 2, z = zero_code(type);
    const int64_t units = K / n16;
    for (int j = 0; j < NR; ++j) {
        const uint8_t *row = j < nt ? seg->data + (o0 + j) * seg->row_bytes : NULL;
        for (int64_t U = 0; U < units; ++U) {
            int16_t c[32] __attribute__((aligned(32)));
            float d = 0.f, m = 0.f;
            if (row) {
                int u;
                const uint8_t *p = unit_block(type, row, U, &u);
                __m256i a = _mm256_setzero_si256(), b = a;
                codes(type, p, u, &a, &b);
                _mm256_store_si256((__m256i *)c, _mm256_sub_epi16(a, _mm256_set1_epi16((short)z)));
                if (n16 == 32) _mm256_store_si256((__m256i *)(c + 16), _mm256_sub_epi16(b, _mm256_set1_epi16((short)z)));
                unit_scale(type, p, u, &d, &m);
            } else {
                memset(c, 0, sizeof c);
            }
            int32_t two[16];
            memcpy(two, c, sizeof two);
            for (int q = 0; q < P; ++q) pairs[(U * P + q) * NR + j] = two[q];
            D[U * NR + j] = d, M[U * NR + j] = m;
        }
    }
}

/* Rows r0 … r0 + mr − 1 of x against one packed tile of nt ≤ NR outputs (y's columns from col). */
INLINE void tile_rows(int64_t type, int mr, const int32_t *pairs, const float *D, const float *M, const Input *in,
                      int64_t r0, float *y, int64_t ldy, int nt, const float *bias) {
    const int n16 = unit_size(type), P = n16 / 2, minimum = has_minimum(type);
    const int64_t units = in->K / n16;
    __m512 acc[MR][2], off[MR][2];
    const int16_t *x[MR];
    const float *s[MR], *X[MR];
    for (int r = 0; r < mr; ++r) {
        acc[r][0] = acc[r][1] = off[r][0] = off[r][1] = _mm512_setzero_ps();
        x[r] = in->xq + (r0 + r) * in->K, s[r] = scales_of(type, in, r0 + r), X[r] = sums_of(type, in, r0 + r);
    }
    for (int64_t U = 0; U < units; ++U) {
        __m512i I[MR][2];
        for (int r = 0; r < mr; ++r) I[r][0] = I[r][1] = _mm512_setzero_si512();
        const int32_t *w = pairs + U * P * NR;
        for (int q = 0; q < P; ++q) {
            const __m512i w0 = _mm512_loadu_si512(w + q * NR), w1 = _mm512_loadu_si512(w + q * NR + 16);
            for (int r = 0; r < mr; ++r) {
                int32_t pair;
                memcpy(&pair, x[r] + U * n16 + 2 * q, 4);
                const __m512i xp = _mm512_set1_epi32(pair);
                I[r][0] = _mm512_dpwssd_epi32(I[r][0], w0, xp), I[r][1] = _mm512_dpwssd_epi32(I[r][1], w1, xp);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(D + U * NR), d1 = _mm512_loadu_ps(D + U * NR + 16);
        for (int r = 0; r < mr; ++r) {
            const __m512 sr = _mm512_set1_ps(s[r][U]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(d0, sr), _mm512_cvtepi32_ps(I[r][0]), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(d1, sr), _mm512_cvtepi32_ps(I[r][1]), acc[r][1]);
        }
        if (minimum) {
            const __m512 m0 = _mm512_loadu_ps(M + U * NR), m1 = _mm512_loadu_ps(M + U * NR + 16);
            for (int r = 0; r < mr; ++r) {
                const __m512 Xr = _mm512_set1_ps(X[r][U]);
                off[r][0] = _mm512_fmadd_ps(m0, Xr, off[r][0]), off[r][1] = _mm512_fmadd_ps(m1, Xr, off[r][1]);
            }
        }
    }
    const __mmask16 k0 = nt >= 16 ? 0xFFFF : (__mmask16)((1u << nt) - 1);
    const __mmask16 k1 = nt >= 32 ? 0xFFFF : nt <= 16 ? 0 : (__mmask16)((1u << (nt - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < mr; ++r) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, _mm512_add_ps(_mm512_add_ps(acc[r][0], off[r][0]), b0));
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, _mm512_add_ps(_mm512_add_ps(acc[r][1], off[r][1]), b1));
    }
}

/* One packed tile against every row of x, MR rows at a time (the count a constant in each call). */
INLINE void tile_all_rows(int64_t type, const int32_t *pairs, const float *D, const float *M, const Input *in,
                          int64_t R, float *y, int64_t N, int nt, const float *bias) {
    int64_t r = 0;
    for (; r + MR <= R; r += MR) tile_rows(type, MR, pairs, D, M, in, r, y + r * N, N, nt, bias);
    switch (R - r) {
    case 3: tile_rows(type, 3, pairs, D, M, in, r, y + r * N, N, nt, bias); break;
    case 2: tile_rows(type, 2, pairs, D, M, in, r, y + r * N, N, nt, bias); break;
    case 1: tile_rows(type, 1, pairs, D, M, in, r, y + r * N, N, nt, bias); break;
    }
}

static void tile_product(const Segment *seg, const int32_t *pairs, const float *D, const float *M, const Input *in,
                         int64_t R, float *y, int64_t N, int nt, const float *bias) {
    switch (seg->type) {
    case Q4_0: tile_all_rows(Q4_0, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q4_1: tile_all_rows(Q4_1, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q5_0: tile_all_rows(Q5_0, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q5_1: tile_all_rows(Q5_1, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q8_0: tile_all_rows(Q8_0, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q2_K: tile_all_rows(Q2_K, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q3_K: tile_all_rows(Q3_K, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q4_K: tile_all_rows(Q4_K, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q5_K: tile_all_rows(Q5_K, pairs, D, M, in, R, y, N, nt, bias); break;
    case Q6_K: tile_all_rows(Q6_K, pairs, D, M, in, R, y, N, nt, bias); break;
    }
}

/* Whether this build has the many-rows product (else the caller dequantises blocks for its BLAS). */
int hybridlm_blockquant_gemm(void) { return 1; }

/* y [R, N] = x Ŵᵀ + b as hybridlm_blockquant_affine, for many rows (tiles of NR outputs over the
 * OpenMP team). Returns 0, or −1 without scratch memory (y is then not written completely). */
int hybridlm_blockquant_many(const float *x, int64_t R, int64_t K, const Segment *segs, int64_t nseg, const float *b,
                             int64_t N, float *y) {
    Input in;
    if (prepare(x, R, K, &in)) return -1;
    int64_t tiles = 0;
    for (int64_t i = 0; i < nseg; ++i) tiles += (segs[i].rows + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t units = K / 16; /* (room for units of 16 or 32) */
        int32_t *pairs = malloc(sizeof(int32_t) * (size_t)(units * 8 * NR) + 2 * sizeof(float) * (size_t)(units * NR));
        if (!pairs) {
#pragma omp atomic write
            failed = 1;
        }
        float *D = pairs ? (float *)(pairs + units * 8 * NR) : NULL, *M = D ? D + units * NR : NULL;
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tiles; ++t) {
            if (!pairs) continue;
            int64_t i = 0, first = t, col = 0; /* the segment of tile t, and the tile's place in it */
            while (first >= (segs[i].rows + NR - 1) / NR) first -= (segs[i].rows + NR - 1) / NR, col += segs[i].rows, ++i;
            const int64_t o0 = first * NR;
            const int nt = (int)(segs[i].rows - o0 < NR ? segs[i].rows - o0 : NR);
            pack_tile(segs[i].type, &segs[i], K, o0, nt, pairs, D, M);
            tile_product(&segs[i], pairs, D, M, &in, R, y + col + o0, N, nt, b ? b + col + o0 : NULL);
        }
        free(pairs);
    }
    free(in.xq);
    return failed ? -1 : 0;
}
#else
int hybridlm_blockquant_gemm(void) { return 0; }

int hybridlm_blockquant_many(const float *x, int64_t R, int64_t K, const Segment *segs, int64_t nseg, const float *b,
                             int64_t N, float *y) {
    return hybridlm_blockquant_affine(x, R, K, segs, nseg, b, N, y);
}
#endif

/* y [R, N] = x Ŵᵀ + b for x [R, K] float32 (rows contiguous) and Ŵ the stack of `nseg` segments
 * (N rows together, each K wide: K a multiple of their block sizes); b [N] or NULL. Returns 0,
 * or −1 when the scratch for x̂ could not be allocated (y is then untouched). */
int hybridlm_blockquant_affine(const float *x, int64_t R, int64_t K, const Segment *segs, int64_t nseg,
                               const float *b, int64_t N, float *y) {
    Input in;
    if (prepare(x, R, K, &in)) return -1;
    const int64_t work = N * (K / 32) * (R < TILE ? R : TILE); /* a few ns per unit: fork above some 25 µs */
#pragma omp parallel if (work > 8192)
    {
#ifdef _OPENMP
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t team = 1, me = 0;
#endif
        const int64_t first = N * me / team, last = N * (me + 1) / team; /* one contiguous range of outputs */
        int64_t col = 0;
        for (int64_t i = 0; i < nseg; col += segs[i].rows, ++i) {
            const int64_t o0 = first > col ? first - col : 0, o1 = last - col < segs[i].rows ? last - col : segs[i].rows;
            if (o0 < o1) rows_of(&segs[i], &in, R, o0, o1, b, col, y, N);
        }
    }
    free(in.xq);
    return 0;
}
