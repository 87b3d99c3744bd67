/* What the kernels' sources share (hybridlm/kernels/__init__.py builds them together). */
#ifndef HYBRIDLM_SIMD_H
#define HYBRIDLM_SIMD_H

#include <math.h>
#include <stdint.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* An IEEE half float (its bits) as a float: exact, subnormals included. */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0)
        v = ldexpf((float)man, -24); /* zero and subnormals */
    else if (exp == 31)
        v = man ? NAN : INFINITY;
    else
        v = ldexpf((float)(man | 0x400), (int)exp - 25);
    return h & 0x8000 ? -v : v;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The sum of the eight lanes of v. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x ≤ 0, eight at a time: x = k ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 in two parts, so r
 * is exact), e^r by its degree-7 Taylor polynomial, times 2^k built in the exponent bits; 0
 * below −87 (near float's least normal number; a NaN stays NaN). Relative error below
 * 8·10⁻⁸ over [−87, 0] (every 0.0007, against double precision): about one unit in the last
 * place, as the vectorised exp inside PyTorch's own attention kernel. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), e); /* (a NaN stays NaN) */
}
#endif

#endif
