/* The float32 affine map of a token step, batch-invariant (see hybridlm/lm/kernels/__init__.py).
 *
 *   y[r, o] = (S₀[r, o] + S₁[r, o]) + b[o],   S₀ = Σ_{k < h} x[r, k] · W[o, k],   S₁ = Σ_{k ≥ h} …
 *
 * with h = half(K) fixed by K alone, and each partial sum taken in the order of k: one fused
 * multiply-add per k into that output's own accumulator, from zero. Every output is the same
 * sequence of roundings whatever the number of rows R, the tiling of rows and columns, or the
 * thread count, so a row's result does not depend on the rows beside it: a sequence of a batch
 * gets the bits it gets alone (a BLAS picks its kernels and splits by the shape, and does not).
 *
 * Layout: W is stored column by column, as every hybridlm.lm.linear.Linear stores it: Wᵀ is a
 * contiguous [K, ldw] matrix and W[o, k] = Wt[k · ldw + o]. Each step of k then reads one row of
 * Wᵀ, the "axpy" order of a matrix-vector product, which streams the weights once for all rows.
 *
 * Why two halves: a token step of one sequence is bound by how fast the weights stream in. With
 * the two halves of K on two threads, each reads one contiguous block of Wᵀ; split by columns
 * instead, each read a short piece of every row, and a 576-wide matrix streamed a third slower.
 * More threads split each half's columns as well.
 *
 * The AVX2 path streams the rows of Wᵀ past a block of outputs held in cache, several rows at a
 * time (the multiply-adds of an output still in the order of k), once for all rows of x. With
 * AVX-512, one row takes 16 columns at a time, and several rows keep 32 columns of up to 8 rows'
 * outputs in registers while 16 rows of Wᵀ go past (the same bits). Without AVX2 and FMA the
 * same sums run as plain loops (separate multiply and add: -ffp-contract=off), a different but
 * equally batch-invariant rounding.
 */
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

enum { QUAD = 4, ROWS1 = 16, BLOCK = 8192 };

/* Where S₁ begins: half of K, a whole number of quads (S₀ is empty below 2·QUAD). */
static inline int64_t half(int64_t K) { return K / 2 / QUAD * QUAD; }

#ifdef HYBRIDLM_AVX2
/* Rows r < R of y, columns o0 ≤ o < o1 (a multiple of 8 apart), advanced by the k-rows
 * k0 ≤ k < k0 + q of Wᵀ (q ≤ 4), in the order of k: y ← fma(x[r, k], Wᵀ[k, o], y) for k = k0, k0 + 1, …
 * Each of the q rows of Wᵀ streams past once, contiguous, for all R rows of x (row stride ldx). */
static inline void quad(int64_t R, int64_t ldx, const float *x, const float *wt, int64_t ldw, int64_t k0, int q,
                        int64_t o0, int64_t o1, float *y, int64_t ldy) {
    const float *w0 = wt + k0 * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    int64_t o = o0;
#ifdef __AVX512F__
    if (q == QUAD)
        for (; o + 32 <= o1; o += 32) { /* 32 columns in two 16-wide vectors (each output's order unchanged) */
            const __m512 v0 = _mm512_loadu_ps(w0 + o), v1 = _mm512_loadu_ps(w1 + o), v2 = _mm512_loadu_ps(w2 + o),
                         v3 = _mm512_loadu_ps(w3 + o), e0 = _mm512_loadu_ps(w0 + o + 16),
                         e1 = _mm512_loadu_ps(w1 + o + 16), e2 = _mm512_loadu_ps(w2 + o + 16),
                         e3 = _mm512_loadu_ps(w3 + o + 16);
            for (int64_t r = 0; r < R; ++r) {
                const float *xr = x + r * ldx + k0;
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
                         v3 = _mm256_loadu_ps(w3 + o), e0 = _mm256_loadu_ps(w0 + o + 8),
                         e1 = _mm256_loadu_ps(w1 + o + 8), e2 = _mm256_loadu_ps(w2 + o + 8),
                         e3 = _mm256_loadu_ps(w3 + o + 8);
            for (int64_t r = 0; r < R; ++r) {
                const float *xr = x + r * ldx + k0;
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
            const float *xr = x + r * ldx + k0;
            float *yr = y + r * ldy + o;
            __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), v0, _mm256_loadu_ps(yr));
            if (q > 1) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), v1, a);
            if (q > 2) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 2), v2, a);
            if (q > 3) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 3), v3, a);
            _mm256_storeu_ps(yr, a);
        }
    }
}

/* One row (a token step of one sequence), columns o0 ≤ o < o1 (a multiple of 8 apart), advanced
 * by the k-rows 0 ≤ k < K of Wᵀ: ROWS1 rows stream past per pass over y (y is read and written
 * K/ROWS1 times, not K/4), each output's multiply-adds in the order of k as in quad(). */
static void one_row(int64_t K, const float *x, const float *wt, int64_t ldw, int64_t o0, int64_t o1, float *y) {
    int64_t k = 0;
    for (; k + ROWS1 <= K; k += ROWS1) {
        const float *w = wt + k * ldw;
        int64_t o = o0;
#ifdef __AVX512F__
        __m512 u[ROWS1];
        for (int j = 0; j < ROWS1; ++j) u[j] = _mm512_set1_ps(x[k + j]);
        for (; o + 16 <= o1; o += 16) {
            __m512 a = _mm512_loadu_ps(y + o);
            for (int j = 0; j < ROWS1; ++j) a = _mm512_fmadd_ps(u[j], _mm512_loadu_ps(w + j * ldw + o), a);
            _mm512_storeu_ps(y + o, a);
        }
#endif
        __m256 v[ROWS1];
        for (int j = 0; j < ROWS1; ++j) v[j] = _mm256_broadcast_ss(x + k + j);
        for (; o < o1; o += 8) {
            __m256 a = _mm256_loadu_ps(y + o);
            for (int j = 0; j < ROWS1; ++j) a = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(w + j * ldw + o), a);
            _mm256_storeu_ps(y + o, a);
        }
    }
    for (; k < K; k += QUAD) quad(1, K, x, wt, ldw, k, K - k < QUAD ? (int)(K - k) : QUAD, o0, o1, y, 0);
}

/* The strip kernel in the build's widest vectors: 16 floats and 8 rows in AVX-512's 32
 * registers, 8 floats and 4 rows in AVX2's 16. */
#ifdef __AVX512F__
typedef __m512 vec;
#define VEC 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vbroadcast _mm512_set1_ps
#define vfma _mm512_fmadd_ps
enum { GROUP = 8 };
#else
typedef __m256 vec;
#define VEC 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vbroadcast _mm256_set1_ps
#define vfma _mm256_fmadd_ps
enum { GROUP = 4 };
#endif
enum { STRIP = 16, PANEL = 2 * VEC };

/* nr ≤ GROUP rows of y, PANEL columns, advanced by the STRIP k-rows of Wᵀ at w: the outputs
 * stay in registers across the strip (each output's multiply-adds still one per k, in the order
 * of k), so y is read and written once per STRIP rows of Wᵀ, and each loaded piece of Wᵀ serves
 * nr rows of x. nr is a constant at every call (the arrays become registers). */
static inline __attribute__((always_inline)) void strip(int nr, const float *x, int64_t ldx, const float *w,
                                                        int64_t ldw, float *y, int64_t ldy) {
    vec a[GROUP], c[GROUP];
    for (int r = 0; r < nr; ++r) a[r] = vload(y + r * ldy), c[r] = vload(y + r * ldy + VEC);
    for (int j = 0; j < STRIP; ++j) {
        const vec v = vload(w + j * ldw), e = vload(w + j * ldw + VEC);
        for (int r = 0; r < nr; ++r) {
            const vec u = vbroadcast(x[r * ldx + j]);
            a[r] = vfma(u, v, a[r]), c[r] = vfma(u, e, c[r]);
        }
    }
    for (int r = 0; r < nr; ++r) vstore(y + r * ldy, a[r]), vstore(y + r * ldy + VEC, c[r]);
}

/* Rows of x in groups of GROUP, then 4, 2, 1, through strip (the same bits whatever the grouping). */
static void panel(int64_t R, const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + GROUP <= R; r += GROUP) strip(GROUP, x + r * ldx, ldx, w, ldw, y + r * ldy, ldy);
    if (GROUP > 4 && r + 4 <= R) strip(4, x + r * ldx, ldx, w, ldw, y + r * ldy, ldy), r += 4;
    if (r + 2 <= R) strip(2, x + r * ldx, ldx, w, ldw, y + r * ldy, ldy), r += 2;
    if (r < R) strip(1, x + r * ldx, ldx, w, ldw, y + r * ldy, ldy);
}

/* Several rows (a batch's token step, a barrier's fork), columns o0 ≤ o < o1: STRIP rows of Wᵀ
 * at a time past PANEL columns of every row's outputs held in registers, along whole rows of
 * Wᵀ; the columns left over, and the k-rows after the last whole strip, go through quad() (the
 * order of k unchanged). The next strip is fetched while this one is multiplied: read a panel
 * at a time, the rows of Wᵀ arrive too late for the CPU's own prefetcher. */
static void many_rows(int64_t R, int64_t K, int64_t ldx, const float *x, const float *wt, int64_t ldw, int64_t o0,
                      int64_t o1, float *y, int64_t ldy) {
    int64_t k = 0;
    for (; k + STRIP <= K; k += STRIP) {
        int64_t o = o0;
        for (; o + PANEL <= o1; o += PANEL) {
            if (k + 2 * STRIP <= K)
                for (int j = 0; j < STRIP; ++j)
                    for (int line = 0; line < PANEL; line += 16)
                        _mm_prefetch((const char *)(wt + (k + STRIP + j) * ldw + o + line), _MM_HINT_T0);
            panel(R, x + k, ldx, wt + k * ldw + o, ldw, y + o, ldy);
        }
        if (o < o1)
            for (int64_t q = k; q < k + STRIP; q += QUAD) quad(R, ldx, x, wt, ldw, q, QUAD, o, o1, y, ldy);
    }
    for (; k < K; k += QUAD) quad(R, ldx, x, wt, ldw, k, K - k < QUAD ? (int)(K - k) : QUAD, o0, o1, y, ldy);
}

/* A partial sum from zero, y[r, o] = Σ_{k < K} x[r, k] · Wᵀ[k, o], for columns o0 ≤ o < o1 (a
 * multiple of 8 apart): one row in blocks of columns whose outputs stay in L1 while the rows of
 * Wᵀ stream past; several rows through many_rows, all the columns at once. */
static void vector_columns(int64_t R, int64_t K, int64_t ldx, const float *x, const float *wt, int64_t ldw,
                           int64_t o0, int64_t o1, float *y, int64_t ldy) {
    if (R > 1) {
        for (int64_t r = 0; r < R; ++r)
            for (int64_t o = o0; o < o1; o += 8) _mm256_storeu_ps(y + r * ldy + o, _mm256_setzero_ps());
        many_rows(R, K, ldx, x, wt, ldw, o0, o1, y, ldy);
        return;
    }
    for (int64_t c0 = o0; c0 < o1; c0 += BLOCK) {
        const int64_t c1 = c0 + BLOCK < o1 ? c0 + BLOCK : o1;
        for (int64_t o = c0; o < c1; o += 8) _mm256_storeu_ps(y + o, _mm256_setzero_ps());
        one_row(K, x, wt, ldw, c0, c1, y);
    }
}
#endif

/* The same partial sum in plain loops, for columns o0 ≤ o < o1 (the remainder of the vectors,
 * and the whole product without AVX2). */
static void columns(int64_t R, int64_t K, int64_t ldx, const float *x, const float *wt, int64_t ldw,
                    int64_t o0, int64_t o1, float *y, int64_t ldy) {
    for (int64_t r = 0; r < R; ++r) {
        const float *xr = x + r * ldx;
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
    }
}

/* The partial sum over the k-rows k0 ≤ k < k1, columns o0 ≤ o < o1, into y [R, ldy]. */
static void partial(int64_t R, int64_t K, const float *x, const float *wt, int64_t ldw, int64_t k0, int64_t k1,
                    int64_t o0, int64_t o1, float *y, int64_t ldy) {
    x += k0, wt += k0 * ldw;
#ifdef HYBRIDLM_AVX2
    const int64_t vec = o0 + (o1 - o0) / 8 * 8; /* columns in whole vectors; the rest in plain loops */
    if (o0 < vec) vector_columns(R, k1 - k0, K, x, wt, ldw, o0, vec, y, ldy);
    if (vec < o1) columns(R, k1 - k0, K, x, wt, ldw, vec, o1, y, ldy);
#else
    columns(R, k1 - k0, K, x, wt, ldw, o0, o1, y, ldy);
#endif
}

/* S₁ of the current call: kept per calling thread, grown as needed (a step's few rows). */
static _Thread_local float *second;
static _Thread_local int64_t second_size;

/* y [R, N] = x [R, K] Wᵀ + b, W given as Wᵀ [K, ldw] (ldw ≥ N), b [N] or NULL. Returns 0, or −1
 * when the scratch for S₁ could not be allocated (y is then not written). */
int hybridlm_affine(const float *x, int64_t R, int64_t K, const float *wt, int64_t ldw, const float *b, int64_t N,
                    float *y) {
    if (R * N > second_size) {
        float *grown = realloc(second, (size_t)(R * N) * sizeof(float));
        if (!grown) return -1;
        second = grown, second_size = R * N;
    }
    float *s1 = second;
    const int64_t h = half(K);
#ifdef _OPENMP
    const int team = R * K * N > 65536 ? omp_get_max_threads() : 1;
#else
    const int team = 1;
#endif
    const int parts = team > 1 ? team / 2 : 1;              /* column parts of each half */
    const int64_t per = ((N + 7) / 8 + parts - 1) / parts * 8; /* contiguous, whole vectors */
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int unit = 0; unit < 2 * parts; ++unit) {
        const int64_t o0 = (unit / 2) * per, o1 = o0 + per < N ? o0 + per : N;
        if (o0 < o1) {
            if (unit % 2 == 0) partial(R, K, x, wt, ldw, 0, h, o0, o1, y, N);
            else partial(R, K, x, wt, ldw, h, K, o0, o1, s1, N);
        }
    }
    for (int64_t r = 0; r < R; ++r) /* y = (S₀ + S₁) + b, the same two roundings for every output */
        for (int64_t o = 0; o < N; ++o) {
            float v = y[r * N + o] + s1[r * N + o];
            y[r * N + o] = b ? v + b[o] : v;
        }
    return 0;
}
