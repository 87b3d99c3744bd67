/* The float32 affine map of a token step, batch-invariant (see hybridlm/lm/kernels/__init__.py).
 *
 *   y[r, o] = (Σ_k x[r, k] · W[o, k]) + b[o]
 *
 * with the sum taken in the order k = 0, 1, …, K − 1 for every (r, o): one fused multiply-add per
 * k into that output's own accumulator, then the bias. Every output is the same sequence of
 * roundings whatever the number of rows R, the tiling of rows and columns, or the thread count,
 * so a row's result does not depend on the rows beside it: a sequence of a batch gets the bits
 * it gets alone (a BLAS picks its kernels and splits by the shape, and does not).
 *
 * Layout: W is stored column by column, as every hybridlm.lm.linear.Linear stores it: Wᵀ is a
 * contiguous [K, ldw] matrix and W[o, k] = Wt[k · ldw + o]. Each step of k then reads one row of
 * Wᵀ, the "axpy" order of a matrix-vector product, which streams the weights once for all rows.
 *
 * The AVX2 path gives each thread of PyTorch's OpenMP pool its own contiguous columns and
 * streams the rows of Wᵀ past them four at a time (four long sequential reads, the outputs in
 * cache, the four multiply-adds of an output in the order of k), once for all rows of x.
 * Without AVX2 and FMA the same order runs as plain loops (with separate multiply and add:
 * -ffp-contract=off), a different but equally batch-invariant rounding.
 */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

enum { QUAD = 4, BLOCK = 8192 };

#ifdef HYBRIDLM_AVX2
/* Rows r < R of y, columns o0 ≤ o < o1 (a multiple of 8 apart), advanced by the k-rows
 * k0 ≤ k < k0 + q of Wᵀ (q ≤ 4), in the order of k: y ← fma(x[r, k], Wᵀ[k, o], y) for k = k0, k0 + 1, …
 * Each of the q rows of Wᵀ streams past once, contiguous, for all R rows of x. */
static inline void quad(int64_t R, int64_t K, const float *x, const float *wt, int64_t ldw, int64_t k0, int q,
                        int64_t o0, int64_t o1, float *y, int64_t ldy) {
    const float *w0 = wt + k0 * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    if (R == 1 && q == QUAD) { /* a token step of one sequence: the four inputs held in registers */
        const __m256 u0 = _mm256_broadcast_ss(x + k0), u1 = _mm256_broadcast_ss(x + k0 + 1);
        const __m256 u2 = _mm256_broadcast_ss(x + k0 + 2), u3 = _mm256_broadcast_ss(x + k0 + 3);
        for (int64_t o = o0; o < o1; o += 8) {
            __m256 a = _mm256_loadu_ps(y + o);
            a = _mm256_fmadd_ps(u0, _mm256_loadu_ps(w0 + o), a);
            a = _mm256_fmadd_ps(u1, _mm256_loadu_ps(w1 + o), a);
            a = _mm256_fmadd_ps(u2, _mm256_loadu_ps(w2 + o), a);
            a = _mm256_fmadd_ps(u3, _mm256_loadu_ps(w3 + o), a);
            _mm256_storeu_ps(y + o, a);
        }
        return;
    }
    int64_t o = o0;
#ifdef __AVX512F__
    if (q == QUAD)
        for (; o + 32 <= o1; o += 32) { /* 32 columns in two 16-wide vectors (each output's order unchanged) */
            const __m512 v0 = _mm512_loadu_ps(w0 + o), v1 = _mm512_loadu_ps(w1 + o), v2 = _mm512_loadu_ps(w2 + o),
                         v3 = _mm512_loadu_ps(w3 + o), e0 = _mm512_loadu_ps(w0 + o + 16),
                         e1 = _mm512_loadu_ps(w1 + o + 16), e2 = _mm512_loadu_ps(w2 + o + 16),
                         e3 = _mm512_loadu_ps(w3 + o + 16);
            for (int64_t r = 0; r < R; ++r) {
                const float *xr = x + r * K + k0;
                float *yr = y + r * ldy + o;
                __m512 a = _mm512_loadu_ps(yr), c = _mm512_loadu_ps(yr + 16), u = _mm512_set1_ps(xr[0]);
                a = _mm512_fmadd_ps(u, v0, a), c = _mm512_fmadd_ps(u, e0, c), u = _mm512_set1_ps(xr[1]);
                a = _mm512_fmadd_ps(u, v1, a), c = _mm512_fmadd_ps(u, e1, c), u = _mm512_set1_ps(xr[2]);
                a = _mm512_fmadd_ps(u, v2, a), c = _mm512_fmadd_ps(u, e2, c), u = _mm512_set1_ps(xr[3]);
                a = _mm512_fmadd_ps(u, v3, a), c = _mm512_fmadd_ps(u, e3, c);
                _mm512_storeu_ps(yr, a), _mm512_storeu_ps(yr + 16, c);
            }
        }
#endif
    if (q == QUAD)
        for (; o + 16 <= o1; o += 16) { /* 16 columns: each input broadcast once for two vectors */
            const __m256 v0 = _mm256_loadu_ps(w0 + o), v1 = _mm256_loadu_ps(w1 + o), v2 = _mm256_loadu_ps(w2 + o),
                         v3 = _mm256_loadu_ps(w3 + o), e0 = _mm256_loadu_ps(w0 + o + 8), e1 = _mm256_loadu_ps(w1 + o + 8),
                         e2 = _mm256_loadu_ps(w2 + o + 8), e3 = _mm256_loadu_ps(w3 + o + 8);
            for (int64_t r = 0; r < R; ++r) {
                const float *xr = x + r * K + k0;
                float *yr = y + r * ldy + o;
                __m256 a = _mm256_loadu_ps(yr), c = _mm256_loadu_ps(yr + 8), u = _mm256_broadcast_ss(xr);
                a = _mm256_fmadd_ps(u, v0, a), c = _mm256_fmadd_ps(u, e0, c), u = _mm256_broadcast_ss(xr + 1);
                a = _mm256_fmadd_ps(u, v1, a), c = _mm256_fmadd_ps(u, e1, c), u = _mm256_broadcast_ss(xr + 2);
                a = _mm256_fmadd_ps(u, v2, a), c = _mm256_fmadd_ps(u, e2, c), u = _mm256_broadcast_ss(xr + 3);
                a = _mm256_fmadd_ps(u, v3, a), c = _mm256_fmadd_ps(u, e3, c);
                _mm256_storeu_ps(yr, a), _mm256_storeu_ps(yr + 8, c);
            }
        }
    for (; o < o1; o += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + o);
        const __m256 v1 = q > 1 ? _mm256_loadu_ps(w1 + o) : v0, v2 = q > 2 ? _mm256_loadu_ps(w2 + o) : v0;
        const __m256 v3 = q > 3 ? _mm256_loadu_ps(w3 + o) : v0;
        for (int64_t r = 0; r < R; ++r) {
            const float *xr = x + r * K + k0;
            float *yr = y + r * ldy + o;
            __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), v0, _mm256_loadu_ps(yr));
            if (q > 1) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), v1, a);
            if (q > 2) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 2), v2, a);
            if (q > 3) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 3), v3, a);
            _mm256_storeu_ps(yr, a);
        }
    }
}

/* Columns o0 ≤ o < o1 (a multiple of 8 apart) of every row, all of K, in blocks of columns whose
 * outputs for all R rows stay in L1 (BLOCK floats in all) while the rows of Wᵀ stream past.
 * (Holding four rows' outputs in registers over strips of Wᵀ, or packing panels of Wᵀ, measured
 * no faster here: a step of 16 rows stays near 45 ms on two cores either way.) */
static void vector_columns(int64_t R, int64_t K, const float *x, const float *wt, int64_t ldw, const float *b,
                           int64_t o0, int64_t o1, float *y, int64_t ldy) {
    int64_t width = BLOCK / R / 16 * 16;
    width = width < 64 ? 64 : width;
    for (int64_t c0 = o0; c0 < o1; c0 += width) {
        const int64_t c1 = c0 + width < o1 ? c0 + width : o1;
        for (int64_t r = 0; r < R; ++r)
            for (int64_t o = c0; o < c1; o += 8) _mm256_storeu_ps(y + r * ldy + o, _mm256_setzero_ps());
        for (int64_t k = 0; k < K; k += QUAD) quad(R, K, x, wt, ldw, k, K - k < QUAD ? (int)(K - k) : QUAD, c0, c1, y, ldy);
        if (b)
            for (int64_t r = 0; r < R; ++r)
                for (int64_t o = c0; o < c1; o += 8)
                    _mm256_storeu_ps(y + r * ldy + o, _mm256_add_ps(_mm256_loadu_ps(y + r * ldy + o), _mm256_loadu_ps(b + o)));
    }
}
#endif

/* Columns o0 ≤ o < o1 of every row, in the defining order (the remainder of the strips, and the
 * whole product without AVX2). */
static void columns(int64_t R, int64_t K, const float *x, const float *wt, int64_t ldw, const float *b,
                    int64_t o0, int64_t o1, float *y, int64_t ldy) {
    for (int64_t r = 0; r < R; ++r) {
        const float *xr = x + r * K;
        float *yr = y + r * ldy;
        for (int64_t o = o0; o < o1; ++o) yr[o] = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            const float u = xr[k];
            const float *w = wt + k * ldw;
#ifdef HYBRIDLM_AVX2
            for (int64_t o = o0; o < o1; ++o) yr[o] = __builtin_fmaf(u, w[o], yr[o]);
#else
            for (int64_t o = o0; o < o1; ++o) yr[o] += u * w[o];
#endif
        }
        if (b)
            for (int64_t o = o0; o < o1; ++o) yr[o] += b[o];
    }
}

/* y [R, N] = x [R, K] Wᵀ + b, W given as Wᵀ [K, ldw] (ldw ≥ N), b [N] or NULL. */
void hybridlm_affine(const float *x, int64_t R, int64_t K, const float *wt, int64_t ldw, const float *b, int64_t N,
                     float *y) {
#ifdef HYBRIDLM_AVX2
    const int64_t vec = N / 8 * 8; /* columns in whole vectors; the rest in plain loops */
#ifdef _OPENMP
    const int team = R * K * N > 65536 ? omp_get_max_threads() : 1;
#else
    const int team = 1;
#endif
    const int64_t per = (vec / 8 + team - 1) / team * 8; /* each thread its own contiguous columns */
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int part = 0; part < team; ++part) {
        const int64_t o0 = part * per, o1 = o0 + per < vec ? o0 + per : vec;
        if (o0 < o1) vector_columns(R, K, x, wt, ldw, b, o0, o1, y, N);
    }
    if (vec < N) columns(R, K, x, wt, ldw, b, vec, N, y, N);
#else
    columns(R, K, x, wt, ldw, b, 0, N, y, N);
#endif
}
