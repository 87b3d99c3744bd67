/* One decode step of causal attention (docs/theory.md §2–§3): B sequences, one new query row each,
 * against the KV state (see hybridlm/kernels/__init__.py and hybridlm/attention.py).
 *
 * For sequence b, query head h and its key/value head j = ⌊h / (H / H_kv)⌋, at position n:
 *
 *   q ← rot(q), k ← rot(k)           rot(x) = x ⊙ cos_n + swap(x) ⊙ sin_n  (rotary; skipped without it)
 *   K[b, j, n] = k,  V[b, j, n] = v  (the state grows by one row per layer and head)
 *   s_t = (q · K[b, j, t]) · scale,  a = softmax(s) over t ∈ [start, n],  o = Σ_t a_t V[b, j, t]
 *
 * where swap(x) exchanges the two halves of x and sin_n carries the sign of the first half, as
 * in hybridlm.positions.Rotary; each product and sum of the rotation is one rounded float32
 * operation, as PyTorch's element-wise kernels do them, so a row written to the state has the
 * bits PyTorch's rotation gives the same k. start = 0 for global attention, n + 1 − w for a
 * local window w. The pattern a is normalised before the weighted sum.
 *
 * Layout: heads [B, H + 2·H_kv, d] (q heads, then k, then v); K and V of the layer
 * [B, H_kv, cap, d]; cos and sin rows [d] (NULL: no rotary); out [B, H, d].
 *
 * hybridlm_decode_attention does the whole step in one call; the stages (scores with the state
 * rows, pattern, output) do it in three, with the same helpers in the same order, so with
 * nothing replaced between them they give the same bits. The scores, the softmax and the
 * weighted sum run per (b, h) with AVX2 + FMA where compiled in (plain loops otherwise); long
 * contexts split the heads over PyTorch's OpenMP pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

static void rotate(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; ++i) {
        const float a = x[i] * cos[i];
        const float b = x[i < half ? i + half : i - half] * sin[i];
        out[i] = a + b;
    }
}


static float dot(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float total = 0.f;
#ifdef HYBRIDLM_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    total = hsum(_mm256_add_ps(s0, s1));
#endif
    for (; i < d; ++i) total += a[i] * b[i];
    return total;
}

/* s_t = (q · K_t) · scale for the c keys from K. */
static void scores(const float *q, const float *K, int64_t d, int64_t c, float scale, float *s) {
    for (int64_t t = 0; t < c; ++t) s[t] = dot(q, K + t * d, d) * scale;
}

/* a_t = e^{s_t − max s} · (1 / Σ_u e^{s_u − max s}) over c entries, in place: the pattern of one row. */
static void softmax(float *s, int64_t c) {
    float top = -INFINITY;
    for (int64_t t = 0; t < c; ++t) top = s[t] > top ? s[t] : top;
    int64_t t = 0;
    float total = 0.f;
#ifdef HYBRIDLM_AVX2
    const __m256 m = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= c; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum(acc);
#endif
    for (; t < c; ++t) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    const float inv = 1.f / total;
    for (t = 0; t < c; ++t) s[t] *= inv;
}

/* out = Σ_t a_t V_t over c ≥ 1 rows, in the order of t, 64 (else 8) coordinates at a time in
 * registers: rows t < c − 1 from V, the last one from `last` (V + (c − 1)·d where the rows are
 * one block; a fork's own row stands apart from the state it continues). */
static void weighted_sum(const float *a, const float *V, const float *last, int64_t d, int64_t c, float *out) {
    int64_t i = 0;
#ifdef HYBRIDLM_AVX2
    for (; i + 64 <= d; i += 64) {
        __m256 o[8];
        for (int u = 0; u < 8; ++u) o[u] = _mm256_setzero_ps();
        for (int64_t t = 0; t < c - 1; ++t) {
            const __m256 w = _mm256_set1_ps(a[t]);
            const float *v = V + t * d + i;
            for (int u = 0; u < 8; ++u) o[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * u), o[u]);
        }
        const __m256 w = _mm256_set1_ps(a[c - 1]);
        for (int u = 0; u < 8; ++u) o[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(last + i + 8 * u), o[u]);
        for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + i + 8 * u, o[u]);
    }
    for (; i + 8 <= d; i += 8) {
        __m256 o = _mm256_setzero_ps();
        for (int64_t t = 0; t < c - 1; ++t) o = _mm256_fmadd_ps(_mm256_set1_ps(a[t]), _mm256_loadu_ps(V + t * d + i), o);
        o = _mm256_fmadd_ps(_mm256_set1_ps(a[c - 1]), _mm256_loadu_ps(last + i), o);
        _mm256_storeu_ps(out + i, o);
    }
#endif
    for (; i < d; ++i) {
        float o = 0.f;
        for (int64_t t = 0; t < c - 1; ++t) o += a[t] * V[t * d + i];
        o += a[c - 1] * last[i];
        out[i] = o;
    }
}

/* Row n of K and V for every sequence and key/value head: the rotated k (or k) and v, read
 * from sequence b at k + b·stride_b and v + b·stride_b, heads d apart. */
static void write_rows(const float *k, const float *v, int64_t stride_b, int64_t B, int64_t Hkv, int64_t d, float *K,
                       float *V, int64_t cap, int64_t n, const float *cos, const float *sin) {
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < Hkv; ++j) {
            const float *kj = k + b * stride_b + j * d, *vj = v + b * stride_b + j * d;
            float *Kn = K + ((b * Hkv + j) * cap + n) * d, *Vn = V + ((b * Hkv + j) * cap + n) * d;
            if (cos)
                rotate(kj, cos, sin, d, Kn);
            else
                memcpy(Kn, kj, (size_t)d * sizeof(float));
            memcpy(Vn, vj, (size_t)d * sizeof(float));
        }
    }
}

static void query(const float *q, const float *cos, const float *sin, int64_t d, float *out) {
    if (cos)
        rotate(q, cos, sin, d, out);
    else
        memcpy(out, q, (size_t)d * sizeof(float));
}

enum { PARALLEL_WORK = 262144 }; /* B·H·keys·d above which the heads are split over the threads */

/* One query head of one sequence against c ≥ 1 keys: q_in rotated, its scores against the c − 1
 * keys from K and the last key k_last, their softmax, and the weighted sum of the values from V
 * and v_last, into out [d] (the last key and value are K + (c − 1)·d and V + (c − 1)·d where the
 * rows are one block; a fork's own row stands apart from the state it continues). S and A (NULL:
 * not wanted) receive the row of scores and the pattern as the staged step forms them, start + c
 * entries each (−∞ and 0 before `start`). Returns 0, or −1 without scratch memory. */
static int attend(const float *q_in, const float *cos, const float *sin, const float *K, const float *V,
                  const float *k_last, const float *v_last, int64_t d, int64_t c, float scale, float *out,
                  int64_t start, float *S, float *A) {
    float *scratch = malloc(sizeof(float) * (size_t)(c + d));
    if (!scratch) return -1;
    float *q = scratch + c;
    query(q_in, cos, sin, d, q);
    scores(q, K, d, c - 1, scale, scratch);
    scratch[c - 1] = dot(q, k_last, d) * scale;
    if (S) {
        for (int64_t t = 0; t < start; ++t) S[t] = -INFINITY;
        memcpy(S + start, scratch, (size_t)c * sizeof(float));
    }
    softmax(scratch, c);
    if (A) {
        memset(A, 0, (size_t)start * sizeof(float));
        memcpy(A + start, scratch, (size_t)c * sizeof(float));
    }
    weighted_sum(scratch, V, v_last, d, c, out);
    free(scratch);
    return 0;
}

/* The whole step in one call (no hook attached): heads [B, H + 2·H_kv, d] → out [B, H, d].
 * Returns 0, or −1 when scratch memory could not be had (the state is then written, out not). */
int hybridlm_decode_attention(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d, float *K, float *V,
                              int64_t cap, int64_t n, int64_t start, const float *cos, const float *sin, float scale,
                              float *out) {
    const int64_t group = H / Hkv, width = (H + 2 * Hkv) * d, c = n + 1 - start;
    write_rows(heads + H * d, heads + (H + Hkv) * d, width, B, Hkv, d, K, V, cap, n, cos, sin);
    int failed = 0;
#pragma omp parallel for schedule(static) if (B * H * c * d > PARALLEL_WORK) reduction(| : failed)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        const float *Kb = K + ((b * Hkv + j) * cap + start) * d, *Vb = V + ((b * Hkv + j) * cap + start) * d;
        if (attend(heads + b * width + h * d, cos, sin, Kb, Vb, Kb + (c - 1) * d, Vb + (c - 1) * d, d, c, scale,
                   out + (b * H + h) * d, 0, NULL, NULL))
            failed = 1;
    }
    return failed ? -1 : 0;
}

/* The same step in stages, for hooks to see and replace q, k, v, S, A and z between them. With
 * nothing replaced, the stages give the one-call step's bits. */

/* Stage 1: q [B, H, d], k and v [B, H_kv, d] → row n of K and V, and S [B, H, n + 1], the scaled
 * scores of the keys start..n (−∞ before start). Returns 0, or −1 without scratch memory. */
int hybridlm_attention_scores(const float *q, const float *k, const float *v, int64_t B, int64_t H, int64_t Hkv,
                              int64_t d, float *K, float *V, int64_t cap, int64_t n, int64_t start, const float *cos,
                              const float *sin, float scale, float *S) {
    const int64_t group = H / Hkv, c = n + 1 - start;
    write_rows(k, v, Hkv * d, B, Hkv, d, K, V, cap, n, cos, sin);
    int failed = 0;
#pragma omp parallel for schedule(static) if (B * H * c * d > PARALLEL_WORK) reduction(| : failed)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        float *q_rot = malloc(sizeof(float) * (size_t)d);
        if (!q_rot) {
            failed = 1;
            continue;
        }
        query(q + task * d, cos, sin, d, q_rot);
        float *row = S + task * (n + 1);
        for (int64_t t = 0; t < start; ++t) row[t] = -INFINITY;
        scores(q_rot, K + ((b * Hkv + j) * cap + start) * d, d, c, scale, row + start);
        free(q_rot);
    }
    return failed ? -1 : 0;
}

/* Stage 2: A = softmax of each of the rows of S over its columns start..cols − 1 (0 before). */
void hybridlm_attention_pattern(const float *S, int64_t rows, int64_t cols, int64_t start, float *A) {
#pragma omp parallel for schedule(static) if (rows * cols > PARALLEL_WORK / 64)
    for (int64_t r = 0; r < rows; ++r) {
        float *a = A + r * cols;
        memset(a, 0, (size_t)start * sizeof(float));
        memcpy(a + start, S + r * cols + start, (size_t)(cols - start) * sizeof(float));
        softmax(a + start, cols - start);
    }
}

/* Stage 3: O [B, H, d] = A V over the keys start..n (A [B, H, n + 1]). */
void hybridlm_attention_output(const float *A, int64_t B, int64_t H, int64_t Hkv, int64_t d, const float *V,
                               int64_t cap, int64_t n, int64_t start, float *O) {
    const int64_t group = H / Hkv, c = n + 1 - start;
#pragma omp parallel for schedule(static) if (B * H * c * d > PARALLEL_WORK)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        const float *Vb = V + ((b * Hkv + j) * cap + start) * d;
        weighted_sum(A + task * (n + 1) + start, Vb, Vb + (c - 1) * d, d, c, O + task * d);
    }
}

/* The one-call step for a ragged batch: B sequences, each with its own state (its own buffer,
 * capacity and length), as the engine's rows are, or the B rows of one batched state. `rows` is
 * [5, B]: for sequence b, the address of its layer-0 keys, its capacity cap, its length n, and,
 * in floats, the stride from one layer's keys to the next and from a layer's keys to its values
 * (a state of one sequence, [L, 2, 1, H_kv, cap, d]: 2·H_kv·cap·d and H_kv·cap·d; row b of a
 * batched state, [L, 2, B, H_kv, cap, d]: 2·B·H_kv·cap·d and B·H_kv·cap·d). This call reads and
 * writes layer `layer` at position n[b]. window > 0: a local layer reading the last `window`
 * keys. cos and sin are the whole rotary tables [T, d] (NULL: no rotary); row n[b] of them
 * rotates sequence b. Each (b, h) is computed exactly as the single-sequence call computes it,
 * so a row's bits do not depend on its batch. S and A (NULL: not wanted) receive the scores and
 * the pattern, sequence b's H rows of n[b] + 1 entries one after another, as the staged step
 * forms them. Returns 0, or −1 without scratch. */
int hybridlm_decode_attention_batch(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d,
                                    const int64_t *rows, int64_t layer, int64_t window, const float *cos,
                                    const float *sin, float scale, float *out, float *S, float *A) {
    const int64_t group = H / Hkv, width = (H + 2 * Hkv) * d;
    const int64_t *base = rows, *cap = rows + B, *n = rows + 2 * B, *stride = rows + 3 * B, *values = rows + 4 * B;
    int64_t work = 0;
    for (int64_t b = 0; b < B; ++b) {
        float *K = (float *)(intptr_t)base[b] + layer * stride[b], *V = K + values[b];
        const float *cb = cos ? cos + n[b] * d : 0, *sb = sin ? sin + n[b] * d : 0;
        write_rows(heads + b * width + H * d, heads + b * width + (H + Hkv) * d, width, 1, Hkv, d, K, V, cap[b], n[b],
                   cb, sb);
        work += H * (n[b] + 1) * d;
    }
    int failed = 0;
#pragma omp parallel for schedule(static) if (work > PARALLEL_WORK) reduction(| : failed)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        const int64_t start = window > 0 && n[b] + 1 > window ? n[b] + 1 - window : 0, c = n[b] + 1 - start;
        const float *K = (const float *)(intptr_t)base[b] + layer * stride[b];
        const float *Kb = K + (j * cap[b] + start) * d, *Vb = K + values[b] + (j * cap[b] + start) * d;
        int64_t row = h * (n[b] + 1); /* where (b, h) starts in S and A */
        for (int64_t e = 0; S && e < b; ++e) row += H * (n[e] + 1);
        if (attend(heads + b * width + h * d, cos ? cos + n[b] * d : 0, sin ? sin + n[b] * d : 0, Kb, Vb,
                   Kb + (c - 1) * d, Vb + (c - 1) * d, d, c, scale, out + (b * H + h) * d, start,
                   S ? S + row : NULL, A ? A + row : NULL))
            failed = 1;
    }
    return failed ? -1 : 0;
}

/* A fork of one state (a hidden-state barrier's candidates): B one-token continuations at
 * position n, row b of heads the query, key and value of candidate b. Each reads the parent's
 * keys and values start..n − 1 from K and V ([1, H_kv, cap, d] of one layer: shared, not copied)
 * and its own row n, which is written to own_k and own_v [B, H_kv, d] (rotated) instead of the
 * state. Each (b, h) takes the same operations in the same order as the one-sequence step on
 * the state s ∘ w_b, so a candidate's output and rows have the bits that step gives them.
 * Returns 0, or −1 without scratch memory. */
int hybridlm_fork_attention(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d, const float *K,
                            const float *V, int64_t cap, int64_t n, int64_t start, const float *cos, const float *sin,
                            float scale, float *own_k, float *own_v, float *out) {
    const int64_t group = H / Hkv, width = (H + 2 * Hkv) * d, c = n + 1 - start;
    write_rows(heads + H * d, heads + (H + Hkv) * d, width, B, Hkv, d, own_k, own_v, 1, 0, cos, sin);
    int failed = 0;
#pragma omp parallel for schedule(static) if (B * H * c * d > PARALLEL_WORK) reduction(| : failed)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        if (attend(heads + b * width + h * d, cos, sin, K + (j * cap + start) * d, V + (j * cap + start) * d,
                   own_k + (b * Hkv + j) * d, own_v + (b * Hkv + j) * d, d, c, scale, out + (b * H + h) * d, 0,
                   NULL, NULL))
            failed = 1;
    }
    return failed ? -1 : 0;
}
