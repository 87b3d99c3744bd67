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
 * The AVX2 path holds a strip of 32 output columns for up to two rows in registers (eight
 * accumulators) while k runs over the whole of K, and takes the rows two at a time over a strip
 * that stays in cache; strips are split over PyTorch's OpenMP pool. Without AVX2 and FMA the same
 * order runs as plain loops (with separate multiply and add: -ffp-contract=off), a different but
 * equally batch-invariant rounding.
 */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

enum { STRIP = 32, PREFETCH_ROWS = 12, BLOCK = 1024 };

#ifdef HYBRIDLM_AVX2
/* rows ∈ {1, 2} rows of x against the 32 columns of Wᵀ starting at wt (row stride ldw). */
static inline void strip32(int rows, int64_t K, const float *x, int64_t ldx, const float *wt, int64_t ldw,
                           float *y, int64_t ldy, const float *b) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const float *x0 = x, *x1 = x + ldx;
    for (int64_t k = 0; k < K; ++k) {
        const float *w = wt + k * ldw;
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * ldw), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * ldw + 16), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
        const __m256 u = _mm256_broadcast_ss(x0 + k);
        a0 = _mm256_fmadd_ps(u, w0, a0);
        a1 = _mm256_fmadd_ps(u, w1, a1);
        a2 = _mm256_fmadd_ps(u, w2, a2);
        a3 = _mm256_fmadd_ps(u, w3, a3);
        if (rows == 2) {
            const __m256 v = _mm256_broadcast_ss(x1 + k);
            c0 = _mm256_fmadd_ps(v, w0, c0);
            c1 = _mm256_fmadd_ps(v, w1, c1);
            c2 = _mm256_fmadd_ps(v, w2, c2);
            c3 = _mm256_fmadd_ps(v, w3, c3);
        }
    }
    if (b) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        const __m256 b2 = _mm256_loadu_ps(b + 16), b3 = _mm256_loadu_ps(b + 24);
        a0 = _mm256_add_ps(a0, b0), a1 = _mm256_add_ps(a1, b1), a2 = _mm256_add_ps(a2, b2), a3 = _mm256_add_ps(a3, b3);
        c0 = _mm256_add_ps(c0, b0), c1 = _mm256_add_ps(c1, b1), c2 = _mm256_add_ps(c2, b2), c3 = _mm256_add_ps(c3, b3);
    }
    _mm256_storeu_ps(y, a0), _mm256_storeu_ps(y + 8, a1), _mm256_storeu_ps(y + 16, a2), _mm256_storeu_ps(y + 24, a3);
    if (rows == 2) {
        float *y1 = y + ldy;
        _mm256_storeu_ps(y1, c0), _mm256_storeu_ps(y1 + 8, c1), _mm256_storeu_ps(y1 + 16, c2),
            _mm256_storeu_ps(y1 + 24, c3);
    }
}
#endif

#ifdef HYBRIDLM_AVX2
/* One row of x against the columns o0 ≤ o < o1 (a multiple of 32 apart) of Wᵀ, with the outputs
 * held in memory (a block of them stays in L1) while each row of Wᵀ streams past: the same
 * multiply-adds in the same order as strip32, read as one contiguous run per row of Wᵀ. */
static void row_stream(int64_t K, const float *x, const float *wt, int64_t ldw, const float *b, int64_t o0,
                       int64_t o1, float *y) {
    for (int64_t o = o0; o < o1; o += 8) _mm256_storeu_ps(y + o, _mm256_setzero_ps());
    for (int64_t k = 0; k < K; ++k) {
        const __m256 u = _mm256_broadcast_ss(x + k);
        const float *w = wt + k * ldw;
        for (int64_t o = o0; o < o1; o += 32) {
            _mm256_storeu_ps(y + o, _mm256_fmadd_ps(u, _mm256_loadu_ps(w + o), _mm256_loadu_ps(y + o)));
            _mm256_storeu_ps(y + o + 8, _mm256_fmadd_ps(u, _mm256_loadu_ps(w + o + 8), _mm256_loadu_ps(y + o + 8)));
            _mm256_storeu_ps(y + o + 16, _mm256_fmadd_ps(u, _mm256_loadu_ps(w + o + 16), _mm256_loadu_ps(y + o + 16)));
            _mm256_storeu_ps(y + o + 24, _mm256_fmadd_ps(u, _mm256_loadu_ps(w + o + 24), _mm256_loadu_ps(y + o + 24)));
        }
    }
    if (b)
        for (int64_t o = o0; o < o1; o += 8)
            _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), _mm256_loadu_ps(b + o)));
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
    const int64_t strips = N / STRIP;
    if (R == 1) { /* a single row streams Wᵀ row by row, in blocks of at most BLOCK columns, one per thread at least */
#ifdef _OPENMP
        const int64_t team = K * N > 65536 ? omp_get_max_threads() : 1;
#else
        const int64_t team = 1;
#endif
        int64_t width = (strips + team - 1) / team * STRIP;
        width = width > BLOCK ? BLOCK : width;
        const int64_t blocks = strips ? (strips * STRIP + width - 1) / width : 0;
#pragma omp parallel for schedule(static) if (blocks > 1 && K * N > 65536)
        for (int64_t j = 0; j < blocks; ++j) {
            const int64_t o0 = j * width, o1 = o0 + width < strips * STRIP ? o0 + width : strips * STRIP;
            row_stream(K, x, wt, ldw, b, o0, o1, y);
        }
        if (strips * STRIP < N) columns(R, K, x, wt, ldw, b, strips * STRIP, N, y, N);
        return;
    }
#pragma omp parallel for schedule(static) if (strips > 1 && R * K * N > 65536)
    for (int64_t s = 0; s < strips; ++s) {
        const int64_t o = s * STRIP;
        for (int64_t r = 0; r < R; r += 2) {
            const int rows = R - r >= 2 ? 2 : 1;
            strip32(rows, K, x + r * K, K, wt + o, ldw, y + r * N + o, N, b ? b + o : 0);
        }
    }
    if (strips * STRIP < N) columns(R, K, x, wt, ldw, b, strips * STRIP, N, y, N);
#else
    columns(R, K, x, wt, ldw, b, 0, N, y, N);
#endif
}
