/* A token step of the blocks (docs/theory.md §2): R rows, one new position each, through consecutive
 * blocks in one call, where no hook that may replace a state watches those blocks (hooks that
 * only observe get the states from the taps afterwards; see hybridlm/lm/kernels/__init__.py and
 * hybridlm/lm/step.py). For block ℓ,
 *
 *   h̃ = h + Attn_ℓ(LN_{ℓ,1}(h)) W_O + b_O,        h ← h̃ + MLP_ℓ(LN_{ℓ,2}(h̃))
 *
 * with the parts Gemma 2/3 add: each sublayer's output normed before its residual sum (post-norms,
 * RMSNorm with the gains p₁, p₂), each head's q and k RMS-normed before the rotation (QK-norm, over
 * d_k with the gains g_q, g_k), and a local block's own rotary table. A head size d_k apart from
 * D / H needs nothing: every width below is H·d_k or H_kv·d_k, never D.
 *
 * through the products of affine.c (float32), int4.c (int4) or blockquant.c (GGUF's block grids),
 * the attention of attention.c, and the norms and activations below, which the staged path also
 * calls for a token step's rows:
 * the same operations in the same order, so a block's output has the same bits whichever path
 * runs it, and (every kernel being batch-invariant) whatever rows stand beside it.
 *
 *   LayerNorm  μ = Σ_i h_i / D,  σ² = Σ_i (h_i − μ)² / D,  x̂ = (h − μ) · (1 / √(σ² + ε)),  x̂ ⊙ γ + β
 *   RMSNorm    x̂ = h · (1 / √(Σ_i h_i² / D + ε)),  x̂ ⊙ γ
 *   SwiGLU     silu(g) ⊙ u,  silu(g) = g / (1 + e^{−g})
 *   GeGLU      GELU-tanh(g) ⊙ u
 *   GELU-tanh  ½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))
 *
 * Each sum over a row runs in a fixed order (32 lanes, then the lanes in order), each element-wise
 * product and sum is one rounded float32 operation (-ffp-contract=off), and e^x is simd.h's exp8,
 * which attention's softmax uses too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRIDLM_AVX2 1
#endif

/* One affine map x ↦ x Wᵀ + b: float32 with W stored column by column (wt = Wᵀ [K, ldw]), int4
 * on GGUF's Q4_1 grid (packed [N, K/2], d and m [N, K/32]), or nseg segments of GGUF block rows
 * (blockquant.c; segments not NULL). bias [N] or NULL. */
typedef struct {
    const float *wt;
    int64_t ldw;
    const uint8_t *packed;
    const uint16_t *d, *m;
    const float *bias;
    int64_t K, N;
    const Segment *segments;
    int64_t nseg;
} Product;

/* One block's parameters (hybridlm.lm.step.BlockSpec mirrors this layout). */
typedef struct {
    int64_t rms; /* 1: RMSNorm (no β), 0: LayerNorm */
    int64_t mlp; /* MLP_GELU: up = W_fc; MLP_SWIGLU, MLP_GEGLU: up = [W_gate; W_up], 2·d_mlp outputs */
    int64_t layer, window; /* which layer of the state; window 0: global attention */
    float eps, scale;
    const float *g1, *b1, *g2, *b2;
    const float *gq, *gk; /* QK-norm's gains [d_k] (RMSNorm, ε as above), or NULL: none */
    const float *p1, *p2; /* the post-norms' gains [D] (RMSNorm, ε as above), or NULL: none */
    int64_t local;        /* 1: rotate with the local table */
    Product qkv, out, up, down;
} Block;

enum { MLP_GELU, MLP_SWIGLU, MLP_GEGLU };

/* The rotary tables [T, d] (NULL: no rotation): the global blocks', and the local blocks' where
 * they rotate with another base (else the same as the global ones). */
typedef struct {
    const float *cos, *sin, *cos_local, *sin_local;
} Tables;

/* The model's sizes shared by its blocks. */
typedef struct {
    int64_t D, H, Hkv, d, d_mlp;
} Sizes;

static int product(const Product *p, const float *x, int64_t R, float *y) {
    if (p->segments) return hybridlm_blockquant_affine(x, R, p->K, p->segments, p->nseg, p->bias, p->N, y);
    return p->wt ? hybridlm_affine(x, R, p->K, p->wt, p->ldw, p->bias, p->N, y)
                 : hybridlm_int4_affine(x, R, p->K, p->packed, p->d, p->m, p->bias, p->N, y);
}

/* Σ_i (x_i − c)^p over n entries, p = 1 or 2, in a fixed order. */
static float moment(const float *x, int64_t n, float c, int square) {
    int64_t i = 0;
    float total = 0.f;
#ifdef HYBRIDLM_AVX2
    const __m256 cv = _mm256_set1_ps(c);
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)
        for (int u = 0; u < 4; ++u) {
            const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * u), cv);
            s[u] = square ? _mm256_fmadd_ps(v, v, s[u]) : _mm256_add_ps(v, s[u]);
        }
    total = hsum(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
#endif
    for (; i < n; ++i) {
        const float v = x[i] - c;
        total += square ? v * v : v;
    }
    return total;
}

/* out = the norm of each of the R rows of h [R, D]; γ and β may be NULL (x̂ alone, for a hook
 * point that sees the state before the affine part); xhat (NULL: not wanted) receives x̂ too. */
static void norm_rows(const float *h, int64_t R, int64_t D, int64_t rms, float eps, const float *g, const float *b,
                      float *out, float *xhat) {
    for (int64_t r = 0; r < R; ++r) {
        const float *x = h + r * D;
        float *y = out + r * D;
        const float mu = rms ? 0.f : moment(x, D, 0.f, 0) / (float)D;
        const float inv = 1.f / sqrtf(moment(x, D, mu, 1) / (float)D + eps);
        for (int64_t i = 0; i < D; ++i) {
            float v = (x[i] - mu) * inv;
            if (xhat) xhat[r * D + i] = v;
            if (g) v = v * g[i];
            if (b) v = v + b[i];
            y[i] = v;
        }
    }
}

void hybridlm_norm(const float *h, int64_t R, int64_t D, int64_t rms, float eps, const float *g, const float *b,
                   float *out) {
    norm_rows(h, R, D, rms, eps, g, b, out, NULL);
}

#ifdef HYBRIDLM_AVX2
/* silu(g) · u for eight entries: with t = e^{−|g|} ≤ 1, silu(g) = g / (1 + t) for g ≥ 0 and
 * g t / (1 + t) below (e^{−g} itself would overflow for large −g). */
static inline __m256 swiglu8(__m256 g, __m256 u) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    const __m256 t = exp8(_mm256_sub_ps(zero, _mm256_max_ps(g, _mm256_sub_ps(zero, g))));
    const __m256 top = _mm256_blendv_ps(_mm256_mul_ps(g, t), g, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
    return _mm256_mul_ps(_mm256_div_ps(top, _mm256_add_ps(one, t)), u);
}

/* tanh(v) for eight entries: sign(v) (1 − t) / (1 + t) with t = e^{−2|v|}. */
static inline __m256 tanh8(__m256 v) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const __m256 a = _mm256_andnot_ps(sign, v);
    const __m256 t = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), a));
    const __m256 m = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
    return _mm256_or_ps(m, _mm256_and_ps(sign, v));
}
#endif

static inline float swiglu1(float g, float u) {
    const float t = expf(-fabsf(g));
    return (g >= 0.f ? g : g * t) / (1.f + t) * u;
}

static inline float tanh1(float v) {
    const float t = expf(-2.f * fabsf(v)), m = (1.f - t) / (1.f + t);
    return v < 0.f ? -m : m;
}

/* out [R, n] = silu(g) ⊙ u, rows of g and u ldg and ldu apart. */
void hybridlm_swiglu(const float *g, int64_t ldg, const float *u, int64_t ldu, int64_t R, int64_t n, float *out) {
    for (int64_t r = 0; r < R; ++r) {
        const float *gr = g + r * ldg, *ur = u + r * ldu;
        float *y = out + r * n;
        int64_t i = 0;
#ifdef HYBRIDLM_AVX2
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, swiglu8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
#endif
        for (; i < n; ++i) y[i] = swiglu1(gr[i], ur[i]);
    }
}

/* out [R, n] = GELU-tanh of x [R, n]: ½ x (1 + tanh(c (x + 0.044715 x³))), c = √(2/π). */
void hybridlm_gelu(const float *x, int64_t R, int64_t n, float *out) {
    const float c = 0.7978845608028654f, k = 0.044715f;
    for (int64_t r = 0; r < R; ++r) {
        const float *xr = x + r * n;
        float *y = out + r * n;
        int64_t i = 0;
#ifdef HYBRIDLM_AVX2
        const __m256 cv = _mm256_set1_ps(c), kv = _mm256_set1_ps(k), half = _mm256_set1_ps(0.5f),
                     one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            const __m256 inner = _mm256_mul_ps(cv, _mm256_add_ps(v, _mm256_mul_ps(kv, cube)));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, tanh8(inner))));
        }
#endif
        for (; i < n; ++i) {
            const float v = xr[i];
            y[i] = 0.5f * v * (1.f + tanh1(c * (v + k * (v * v * v))));
        }
    }
}

/* Where a block's states lie in its taps (what its hook points see, in their order): offsets in
 * floats of h entering, x̂₁, the q|k|v heads before rotation, the scores S and the pattern A
 * (sequence b's H rows of n_b + 1 entries one after another), z, the attention output, h between,
 * x̂₂, the MLP's pre-activation (gate|up for SwiGLU), its activation, its output, h leaving; and the
 * end. hybridlm.lm.step reads the taps with the same layout. */
enum { RESID_PRE, XHAT1, HEADS, SCORES, PATTERN, Z, ATTN_OUT, RESID_MID, XHAT2, PRE, POST, MLP_OUT, RESID_POST, TAPS };

static void tap_offsets(const Block *blk, const Sizes *z, int64_t R, const int64_t *rows, int64_t off[TAPS + 1]) {
    int64_t keys = 0;
    for (int64_t b = 0; b < R; ++b) keys += z->H * (rows[2 * R + b] + 1);
    const int64_t D = R * z->D, size[TAPS] = {D, D, R * (z->H + 2 * z->Hkv) * z->d, keys, keys, R * z->H * z->d, D, D,
                                               D, R * (blk->mlp != MLP_GELU ? 2 : 1) * z->d_mlp, R * z->d_mlp, D, D};
    off[0] = 0;
    for (int i = 0; i < TAPS; ++i) off[i + 1] = off[i] + size[i];
}

/* Attention for R rows: each against its own state (`rows`: see hybridlm_decode_attention_batch),
 * or, where own is not NULL, R candidates continuing the one state of `rows` (a fork: each reads
 * that state's keys and values and its own new row, which goes to own [2, R, H_kv, d] instead). */
static int attention(const Block *blk, const Sizes *z, const float *heads, int64_t R, const int64_t *rows,
                     const Tables *t, float *o, float *S, float *A, float *own) {
    const float *cos = blk->local ? t->cos_local : t->cos, *sin = blk->local ? t->sin_local : t->sin;
    if (!own)
        return hybridlm_decode_attention_batch(heads, R, z->H, z->Hkv, z->d, rows, blk->layer, blk->window, cos, sin,
                                               blk->scale, o, S, A);
    const int64_t cap = rows[1], n = rows[2], w = blk->window;
    const float *K = (const float *)(intptr_t)rows[0] + blk->layer * rows[3], *V = K + rows[4];
    return hybridlm_fork_attention(heads, R, z->H, z->Hkv, z->d, K, V, cap, n, w > 0 && n + 1 > w ? n + 1 - w : 0,
                                   cos ? cos + n * z->d : NULL, sin ? sin + n * z->d : NULL, blk->scale, own,
                                   own + R * z->Hkv * z->d, o);
}

/* The attention sublayer of block ℓ for R rows: out [R, D] = Attn(LN₁(h)) W_O + b_O, writing
 * row n of layer ℓ of each row's state (`rows`: see hybridlm_decode_attention_batch), or a fork's
 * rows to own (see attention). tap (NULL: none) is the block's taps, laid out by tap_offsets,
 * which receive x̂₁, the heads, S, A and z. */
static int attention_sublayer(const Block *blk, const Sizes *z, const float *h, int64_t R, const int64_t *rows,
                              const Tables *t, float *out, float *tap, float *own) {
    const int64_t width = (z->H + 2 * z->Hkv) * z->d;
    int64_t off[TAPS + 1];
    if (tap) tap_offsets(blk, z, R, rows, off);
    float *r = malloc(sizeof(float) * (size_t)(R * (z->D + width + z->H * z->d)));
    if (!r) return -1;
    float *heads = r + R * z->D, *o = heads + R * width;
    norm_rows(h, R, z->D, blk->rms, blk->eps, blk->g1, blk->b1, r, tap ? tap + off[XHAT1] : NULL);
    int failed = product(&blk->qkv, r, R, heads);
    if (!failed && blk->gq)
        for (int64_t b = 0; b < R; ++b) {
            float *q = heads + b * width, *k = q + z->H * z->d;
            norm_rows(q, z->H, z->d, 1, blk->eps, blk->gq, NULL, q, NULL);
            norm_rows(k, z->Hkv, z->d, 1, blk->eps, blk->gk, NULL, k, NULL);
        }
    if (!failed && tap) memcpy(tap + off[HEADS], heads, sizeof(float) * (size_t)(R * width));
    failed = failed || attention(blk, z, heads, R, rows, t, o, tap ? tap + off[SCORES] : NULL,
                                 tap ? tap + off[PATTERN] : NULL, own);
    if (!failed && tap) memcpy(tap + off[Z], o, sizeof(float) * (size_t)(R * z->H * z->d));
    failed = failed || product(&blk->out, o, R, out);
    if (!failed && blk->p1) norm_rows(out, R, z->D, 1, blk->eps, blk->p1, NULL, out, NULL);
    free(r);
    return failed ? -1 : 0;
}

/* The MLP sublayer of block ℓ for R rows: out [R, D] = MLP(LN₂(h)); tap as above (x̂₂, the
 * pre-activation, the activation). */
static int mlp_sublayer(const Block *blk, const Sizes *z, const float *h, int64_t R, float *out, float *tap,
                        const int64_t *off) {
    const int64_t up = (blk->mlp != MLP_GELU ? 2 : 1) * z->d_mlp;
    float *r = malloc(sizeof(float) * (size_t)(R * (z->D + up + z->d_mlp)));
    if (!r) return -1;
    float *pre = r + R * z->D, *post = pre + R * up;
    norm_rows(h, R, z->D, blk->rms, blk->eps, blk->g2, blk->b2, r, tap ? tap + off[XHAT2] : NULL);
    int failed = product(&blk->up, r, R, pre);
    if (!failed) {
        if (blk->mlp == MLP_SWIGLU)
            hybridlm_swiglu(pre, up, pre + z->d_mlp, up, R, z->d_mlp, post);
        else if (blk->mlp == MLP_GEGLU)
            for (int64_t b = 0; b < R; ++b) { /* GELU-tanh(g), then ⊙ u: the staged path's two roundings */
                float *y = post + b * z->d_mlp;
                const float *u = pre + b * up + z->d_mlp;
                hybridlm_gelu(pre + b * up, 1, z->d_mlp, y);
                for (int64_t i = 0; i < z->d_mlp; ++i) y[i] = y[i] * u[i];
            }
        else
            hybridlm_gelu(pre, R, z->d_mlp, post);
        if (tap) {
            memcpy(tap + off[PRE], pre, sizeof(float) * (size_t)(R * up));
            memcpy(tap + off[POST], post, sizeof(float) * (size_t)(R * z->d_mlp));
        }
        failed = product(&blk->down, post, R, out);
        if (!failed && blk->p2) norm_rows(out, R, z->D, 1, blk->eps, blk->p2, NULL, out, NULL);
    }
    free(r);
    return failed ? -1 : 0;
}

int hybridlm_attention_sublayer(const Block *blk, const Sizes *z, const float *h, int64_t R, const int64_t *rows,
                                const Tables *t, float *out) {
    return attention_sublayer(blk, z, h, R, rows, t, out, NULL, NULL);
}

int hybridlm_mlp_sublayer(const Block *blk, const Sizes *z, const float *h, int64_t R, float *out) {
    return mlp_sublayer(blk, z, h, R, out, NULL, NULL);
}

/* L consecutive blocks for R rows, h [R, D] updated in place: h ← h + attention sublayer, then
 * h ← h + MLP sublayer, block by block. taps (NULL: none) receive each block's states as its
 * hook points see them, block after block, each laid out by tap_offsets: only the residual
 * stream's five (h entering, the attention output, h between, the MLP output, h leaving) where
 * `inner` is 0, every one where it is 1. own (NULL: none): the rows are a fork's candidates of the
 * one state in `rows`, whose new rows go to own [L, 2, R, H_kv, d] (see attention). Returns 0, or
 * −1 without scratch memory (h is then partly advanced: the caller's step has failed). */
int hybridlm_decode_blocks(const Block *blocks, int64_t L, const Sizes *z, float *h, int64_t R, const int64_t *rows,
                           const Tables *t, float *taps, int64_t inner, float *own) {
    const size_t bytes = sizeof(float) * (size_t)(R * z->D);
    float *a = malloc(bytes);
    if (!a) return -1;
    int failed = 0;
    for (int64_t l = 0; l < L && !failed; ++l) {
        int64_t off[TAPS + 1];
        if (taps) tap_offsets(blocks + l, z, R, rows, off); /* (a fork is never tapped: its table has one row) */
        float *tap = taps, *deep = taps && inner ? taps : NULL;
        if (taps) taps += off[TAPS];
        if (tap) memcpy(tap + off[RESID_PRE], h, bytes);
        failed = attention_sublayer(blocks + l, z, h, R, rows, t, a, deep,
                                    own ? own + l * 2 * R * z->Hkv * z->d : NULL);
        for (int64_t i = 0; !failed && i < R * z->D; ++i) h[i] = h[i] + a[i];
        if (tap && !failed) memcpy(tap + off[ATTN_OUT], a, bytes), memcpy(tap + off[RESID_MID], h, bytes);
        failed = failed || mlp_sublayer(blocks + l, z, h, R, a, deep, off);
        for (int64_t i = 0; !failed && i < R * z->D; ++i) h[i] = h[i] + a[i];
        if (tap && !failed) memcpy(tap + off[MLP_OUT], a, bytes), memcpy(tap + off[RESID_POST], h, bytes);
    }
    free(a);
    return failed ? -1 : 0;
}
