/* One decode step of causal attention (SPEC.md §2–3): B sequences, one new query row each,
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
 * operation, as PyTorch's element-wise kernels do them, so the rows written to the state are
 * the bits a prefill writes. start = 0 for global attention, n + 1 − w for a local window w.
 *
 * Layout: heads [B, H + 2·H_kv, d] (q heads, then k, then v); K and V of the layer
 * [B, H_kv, cap, d]; cos and sin rows [d] (NULL: no rotary); out [B, H, d].
 *
 * The scores, the softmax and the weighted sum run per (b, h) with AVX2 + FMA where compiled
 * in (plain loops otherwise); long contexts split the heads over PyTorch's OpenMP pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#ifdef HYBRIDLM_AVX2
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

/* s_t = (q · K_t) · scale for t ∈ [start, stop); returns max_t s_t. */
static float scores(const float *q, const float *K, int64_t d, int64_t start, int64_t stop, float scale, float *s) {
    float top = -INFINITY;
    for (int64_t t = start; t < stop; ++t) {
        s[t - start] = dot(q, K + t * d, d) * scale;
        top = s[t - start] > top ? s[t - start] : top;
    }
    return top;
}

/* s_t ← e^{s_t − top} over c entries; returns Σ_t. */
static float exponentials(float *s, int64_t c, float top) {
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
    return total;
}

/* out = Σ_t e_t V_t / total over t ∈ [start, stop), 64 (else 8) coordinates at a time in registers. */
static void weighted_sum(const float *e, const float *V, int64_t d, int64_t start, int64_t stop, float total,
                         float *out) {
    const float inv = 1.f / total;
    int64_t i = 0;
#ifdef HYBRIDLM_AVX2
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 64 <= d; i += 64) {
        __m256 o[8];
        for (int u = 0; u < 8; ++u) o[u] = _mm256_setzero_ps();
        for (int64_t t = start; t < stop; ++t) {
            const __m256 w = _mm256_set1_ps(e[t - start]);
            const float *v = V + t * d + i;
            for (int u = 0; u < 8; ++u) o[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * u), o[u]);
        }
        for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + i + 8 * u, _mm256_mul_ps(o[u], iv));
    }
    for (; i + 8 <= d; i += 8) {
        __m256 o = _mm256_setzero_ps();
        for (int64_t t = start; t < stop; ++t) o = _mm256_fmadd_ps(_mm256_set1_ps(e[t - start]), _mm256_loadu_ps(V + t * d + i), o);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(o, iv));
    }
#endif
    for (; i < d; ++i) {
        float o = 0.f;
        for (int64_t t = start; t < stop; ++t) o += e[t - start] * V[t * d + i];
        out[i] = o * inv;
    }
}

/* One query head against its keys and values; scratch holds n + 1 − start floats. */
static void head(const float *q, const float *K, const float *V, int64_t d, int64_t start, int64_t stop, float scale,
                 float *scratch, float *out) {
    const float top = scores(q, K, d, start, stop, scale, scratch);
    const float total = exponentials(scratch, stop - start, top);
    weighted_sum(scratch, V, d, start, stop, total, out);
}

/* Returns 0, or −1 when scratch memory could not be had (the state is then written, out not). */
int hybridlm_decode_attention(const float *heads, int64_t B, int64_t H, int64_t Hkv, int64_t d, float *K, float *V,
                              int64_t cap, int64_t n, int64_t start, const float *cos, const float *sin, float scale,
                              float *out) {
    const int64_t group = H / Hkv, width = (H + 2 * Hkv) * d, stop = n + 1;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < Hkv; ++j) {
            const float *k = heads + b * width + (H + j) * d, *v = heads + b * width + (H + Hkv + j) * d;
            float *Kn = K + ((b * Hkv + j) * cap + n) * d, *Vn = V + ((b * Hkv + j) * cap + n) * d;
            if (cos)
                rotate(k, cos, sin, d, Kn);
            else
                memcpy(Kn, k, (size_t)d * sizeof(float));
            memcpy(Vn, v, (size_t)d * sizeof(float));
        }
    }
    int failed = 0;
    const int64_t work = B * H * (stop - start) * d;
#pragma omp parallel for schedule(static) if (work > 262144) reduction(| : failed)
    for (int64_t task = 0; task < B * H; ++task) {
        const int64_t b = task / H, h = task % H, j = h / group;
        float *scratch = malloc(sizeof(float) * (size_t)(stop - start + d));
        if (!scratch) {
            failed = 1;
            continue;
        }
        float *q = scratch + (stop - start);
        const float *qh = heads + b * width + h * d;
        if (cos)
            rotate(qh, cos, sin, d, q);
        else
            memcpy(q, qh, (size_t)d * sizeof(float));
        const float *Kb = K + (b * Hkv + j) * cap * d, *Vb = V + (b * Hkv + j) * cap * d;
        head(q, Kb, Vb, d, start, stop, scale, scratch, out + (b * H + h) * d);
        free(scratch);
    }
    return failed ? -1 : 0;
}
