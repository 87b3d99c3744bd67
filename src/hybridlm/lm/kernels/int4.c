/* The int4 affine map of hybridlm's reduced-precision path (see hybridlm/kernels/__init__.py).
 *
 *   Ŵ[o, 32g + j] = d[o, g] · q[o, g, j] + m[o, g],       q ∈ {0, …, 15}   (GGUF's Q4_1 grid)
 *   y[r, o] = Σ_g d[o, g] · s[r, g] · Σ_j q[o, g, j] · x̂[r, 32g + j]  +  Σ_g m[o, g] · X[r, g]  +  b[o]
 *
 * where x̂[r, 32g + j] = round(x[r, 32g + j] / s[r, g]) ∈ {−32767, …, 32767} with
 * s[r, g] = max_j |x[r, 32g + j]| / 32767 (the input in 16 bits per group of 32), and
 * X[r, g] = Σ_j x[r, 32g + j] (exact, so the offsets m see the float32 input). Each Σ_j q x̂ is
 * an exact integer below 2^24, so it is also exact as a float.
 *
 * Layout: packed[o, 16g + i] holds q[o, g, i] in its low nibble and q[o, g, i + 16] in its high
 * nibble; d[o, g] and m[o, g] are IEEE half floats, as in a Q4_1 block.
 *
 * The AVX2 path forms Σ_j q x̂ of a group with two multiply-adds of 16-bit integers (vpmaddwd)
 * on the unpacked nibbles; each row of x reduces eight groups' sums into one vector and scales
 * them together, tiles of up to TILE rows share each unpacked group, and a row's roundings do
 * not depend on the tile it is in (the product is batch-invariant). Output channels
 * are split over an OpenMP team; the library is linked against the OpenMP runtime PyTorch
 * itself loaded, so the team is PyTorch's own intra-op pool and nothing competes with it for
 * the cores. Without AVX2, FMA and F16C the same sums run as plain loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

enum { GROUP = 32, TILE = 4, AHEAD = 8 };

int hybridlm_vectorised(void) {
#ifdef HYBRIDLM_AVX2
    return 1;
#else
    return 0;
#endif
}

/* The team size the kernel's loops get: the OpenMP runtime's, which is PyTorch's (1 without OpenMP). */
int hybridlm_team(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* x̂ and s of every group of every row, and the exact group sums X. */
static void quantise_input(const float *x, int64_t R, int64_t K, int16_t *xq, float *s, float *X) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) if (R * K > 65536)
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t g = 0; g < G; ++g) {
            const float *xg = x + r * K + g * GROUP;
            float amax = 0.f, sum = 0.f;
            for (int j = 0; j < GROUP; ++j) {
                amax = fmaxf(amax, fabsf(xg[j]));
                sum += xg[j];
            }
            const float scale = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
            for (int j = 0; j < GROUP; ++j) xq[r * K + g * GROUP + j] = (int16_t)lrintf(xg[j] * inv);
            s[r * G + g] = scale;
            X[r * G + g] = sum;
        }
    }
}

#define INLINE static inline __attribute__((always_inline))

#ifdef HYBRIDLM_AVX2
/* The 32 codes of one group (16 bytes at p) as 16-bit integers: q_0 … q_15 in *qa, q_16 … q_31 in *qb. */
INLINE void unpack(const uint8_t *p, __m256i *qa, __m256i *qb) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    *qa = _mm256_cvtepu8_epi16(_mm_and_si128(v, low));
    *qb = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low));
}

/* Σ_j q[g, j] x̂[j] of one group (its codes unpacked), as eight partial sums. */
INLINE __m256i unpacked_dot(__m256i qa, __m256i qb, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(qa, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(qb, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* Σ_j q[g, j] x̂[j] of one group, as eight partial sums. */
INLINE __m256i group_dot(const uint8_t *p, const int16_t *x) {
    __m256i qa, qb;
    unpack(p, &qa, &qb);
    return unpacked_dot(qa, qb, x);
}

/* The integer sums t[u] (eight partial sums each) of the eight groups g … g + 7 of one row: reduced
 * into one vector (lane u: group g + u), scaled by d·s into *acc and offset by m·X into *off. The
 * one place where the float arithmetic of a row's first 8⌊G/8⌋ groups happens, so every row gets
 * the same roundings whether it is alone or in a tile (the integer sums are exact either way). */
INLINE void octet(const __m256i t[8], const uint16_t *d, const uint16_t *m, const float *s, const float *X,
                  __m256 *acc, __m256 *off) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
    const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                          _mm256_permute2x128_si256(a, b, 0x31));
    const __m256 ds = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_loadu_ps(s));
    *acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(sums), *acc);
    *off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m)), _mm256_loadu_ps(X), *off);
}

/* The first 8⌊G/8⌋ groups of the rows t < tile of x̂ against one output channel, into acc[t]. A
 * single row (a token step) unpacks each group as it goes; a tile unpacks eight groups once and
 * shares them among its rows. */
INLINE void tile_octets(int tile, int64_t G, int64_t K, const uint8_t *p, const uint16_t *d, const uint16_t *m,
                        const int16_t *xq, const float *s, const float *X, float *acc) {
    __m256 va[TILE], vo[TILE];
    for (int r = 0; r < tile; ++r) va[r] = vo[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g + 8 <= G; g += 8) {
        __m256i t[8];
        if (tile == 1) {
            for (int u = 0; u < 8; ++u) t[u] = group_dot(p + 16 * (g + u), xq + GROUP * (g + u));
            octet(t, d + g, m + g, s + g, X + g, &va[0], &vo[0]);
            continue;
        }
        __m256i qa[8], qb[8];
        for (int u = 0; u < 8; ++u) unpack(p + 16 * (g + u), &qa[u], &qb[u]);
        for (int r = 0; r < tile; ++r) {
            for (int u = 0; u < 8; ++u) t[u] = unpacked_dot(qa[u], qb[u], xq + r * K + GROUP * (g + u));
            octet(t, d + g, m + g, s + r * G + g, X + r * G + g, &va[r], &vo[r]);
        }
    }
    for (int r = 0; r < tile; ++r) acc[r] = hsum(_mm256_add_ps(va[r], vo[r]));
}
#endif

/* y[t · ldy] for the rows t < tile of x̂ and one output channel (its nibbles p, scales d, offsets
 * m). `tile` is a constant in each call below, so the accumulators stay in registers. Every row
 * takes its groups eight at a time, then the groups left over one at a time: the same roundings
 * for a row whatever the tile, so the product is batch-invariant. */
INLINE void tile_channel(int tile, int64_t K, const uint8_t *p, const uint16_t *d, const uint16_t *m,
                         const int16_t *xq, const float *s, const float *X, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    int64_t g0 = 0;
    float acc[TILE];
    for (int t = 0; t < tile; ++t) acc[t] = 0.f;
#ifdef HYBRIDLM_AVX2
    tile_octets(tile, G, K, p, d, m, xq, s, X, acc);
    g0 = G - G % 8;
    __m256 vacc[TILE];
    for (int t = 0; t < tile; ++t) vacc[t] = _mm256_setzero_ps();
    for (int64_t g = g0; g < G; ++g) {
        __m256i qa, qb;
        unpack(p + 16 * g, &qa, &qb);
        const float dg = half_to_float(d[g]), mg = half_to_float(m[g]);
        for (int t = 0; t < tile; ++t) {
            const __m256i dot = unpacked_dot(qa, qb, xq + t * K + g * GROUP);
            vacc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dg * s[t * G + g]), _mm256_cvtepi32_ps(dot), vacc[t]);
            acc[t] += mg * X[t * G + g];
        }
    }
    for (int t = 0; t < tile; ++t) y[t * ldy] = acc[t] + hsum(vacc[t]);
#else
    for (int64_t g = g0; g < G; ++g) {
        const uint8_t *pg = p + 16 * g;
        const float dg = half_to_float(d[g]), mg = half_to_float(m[g]);
        for (int t = 0; t < tile; ++t) {
            const int16_t *xg = xq + t * K + g * GROUP;
            int32_t dot = 0;
            for (int i = 0; i < 16; ++i) dot += (pg[i] & 0x0F) * xg[i] + (pg[i] >> 4) * xg[i + 16];
            acc[t] += dg * s[t * G + g] * (float)dot + mg * X[t * G + g];
        }
    }
    for (int t = 0; t < tile; ++t) y[t * ldy] = acc[t];
#endif
}

#ifdef HYBRIDLM_AVX2
/* Ask for one output channel's nibbles, scales and offsets ahead of their use. One thread's
 * channels lie one after another, and the CPU's own prefetcher alone left a single row's product
 * waiting on memory: fetched AHEAD channels on, SmolLM2's 121 int4 products took 10.0 instead of
 * 14.9 ms on one thread (the same bits: only loads move). */
static inline void fetch(const uint8_t *p, int64_t bytes, const uint16_t *d, const uint16_t *m, int64_t G) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(p + line), _MM_HINT_T0);
    for (int64_t line = 0; line < 2 * G; line += 64) {
        _mm_prefetch((const char *)d + line, _MM_HINT_T0);
        _mm_prefetch((const char *)m + line, _MM_HINT_T0);
    }
}
#endif

/* y[R, N] = x Ŵᵀ (+ b) for x [R, K] float32 (rows contiguous), K a multiple of 32; b may be NULL.
 * Returns 0, or −1 when the scratch for x̂ could not be allocated (y is then untouched). */
int hybridlm_int4_affine(const float *x, int64_t R, int64_t K, const uint8_t *packed, const uint16_t *d,
                         const uint16_t *m, const float *b, int64_t N, float *y) {
    const int64_t G = K / GROUP;
    int16_t *xq = malloc(2 * (size_t)(R * K) + 2 * sizeof(float) * (size_t)(R * G));
    if (!xq) return -1;
    float *s = (float *)(xq + R * K), *X = s + R * G; /* 2·R·K bytes: aligned for floats */
    quantise_input(x, R, K, xq, s, X);
    const int64_t work = N * G * (R < TILE ? R : TILE); /* about 3 ns per unit: fork above ~25 µs */
#pragma omp parallel for schedule(static) if (work > 8192)
    for (int64_t o = 0; o < N; ++o) {
        const uint8_t *p = packed + o * (K / 2);
        const uint16_t *dg = d + o * G, *mg = m + o * G;
#ifdef HYBRIDLM_AVX2
        if (o + AHEAD < N) /* the channel AHEAD on: a token step waits on memory, not on arithmetic */
            fetch(p + AHEAD * (K / 2), K / 2, dg + AHEAD * G, mg + AHEAD * G, G);
#endif
        for (int64_t r = 0; r < R; r += TILE) {
            const int tile = (int)(R - r < TILE ? R - r : TILE);
            const int16_t *xr = xq + r * K;
            const float *sr = s + r * G, *Xr = X + r * G;
            float *yr = y + r * N + o;
            switch (tile) {
            case 1: tile_channel(1, K, p, dg, mg, xr, sr, Xr, yr, N); break;
            case 2: tile_channel(2, K, p, dg, mg, xr, sr, Xr, yr, N); break;
            case 3: tile_channel(3, K, p, dg, mg, xr, sr, Xr, yr, N); break;
            default: tile_channel(4, K, p, dg, mg, xr, sr, Xr, yr, N); break;
            }
            if (b)
                for (int t = 0; t < tile; ++t) y[(r + t) * N + o] += b[o];
        }
    }
    free(xq);
    return 0;
}

/* Ŵ[o, k] = d[o, g] q[o, g, j] + m[o, g] for the output channels o0 ≤ o < o1, into w [o1 − o0, K]. */
void hybridlm_int4_dequantise(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int64_t K, int64_t o0,
                              int64_t o1, float *w) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) if ((o1 - o0) * K > 65536)
    for (int64_t o = o0; o < o1; ++o) {
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t *p = packed + o * (K / 2) + 16 * g;
            const float dg = half_to_float(d[o * G + g]), mg = half_to_float(m[o * G + g]);
            float *wg = w + (o - o0) * K + g * GROUP;
#ifdef HYBRIDLM_AVX2
            const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
            const __m128i a = _mm_and_si128(v, low), b = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            const __m256 dv = _mm256_set1_ps(dg), mv = _mm256_set1_ps(mg);
            _mm256_storeu_ps(wg, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)), mv));
            _mm256_storeu_ps(wg + 8, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), mv));
            _mm256_storeu_ps(wg + 16, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), mv));
            _mm256_storeu_ps(wg + 24, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), mv));
#else
            for (int i = 0; i < 16; ++i) {
                wg[i] = dg * (float)(p[i] & 0x0F) + mg;
                wg[i + 16] = dg * (float)(p[i] >> 4) + mg;
            }
#endif
        }
    }
}
