/* The per-row operations of a decode or verification step around its projections: RMSNorm,
 * rotary embedding (RoPE) and causal attention over a KV cache, in float32.
 *
 * Why: in a decode step of the default model these are about 30 small torch operations per
 * layer, each a few microseconds of dispatch on tensors of 896 floats (torch.profiler, 2026-12-03:
 * 7 ms of a 46 ms gguf-a8 step, of which attention alone, scaled_dot_product_attention for one
 * query, took 78 us a call). Here each is one call of a few microseconds.
 *
 * Every function computes each row (each query) alone, in a fixed order, so a row's result does
 * not depend on how many rows share the call: a verification step of k + 1 positions gives each
 * position what a one-position step gives it.
 *
 * Built into the same library as gguf_blocks.c (native.py), with its flags: -ffp-contract=off
 * keeps RoPE's x * cos + rot * sin three roundings, as torch computes it (bit for bit equal).
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MI_STEP_AVX2 1
#endif

/* Work (keys x head width x queries) from which attention splits its queries over threads;
 * below it one thread is faster than waking the others (a decode step at a short context). */
#define ATTN_PARALLEL_WORK (1 << 15)

/* a . b over n floats: 8-lane FMA accumulation where n is a multiple of 8, a scalar sum
 * otherwise. The order is fixed per call site, never by the caller's row count. Without AVX2
 * the 8 lanes are fmaf's, summed in the AVX2 path's order (lanes l and l + 4, then 0 + 2 and
 * 1 + 3, then those two), so both builds give the same bits (tests/test_step_ops.py). */
static float dot_f32(const float *a, const float *b, int64_t n) {
    if (n % 8 == 0) {
#ifdef MI_STEP_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
#else
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < n; i += 8)
            for (int l = 0; l < 8; l++) v[l] = fmaf(a[i + l], b[i + l], v[l]);
        return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
    }
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* RMSNorm (Zhang & Sennrich 2019) of x (m, c): out[i] = w[i] * (x[i] * r) with
 * r = 1 / sqrt(sum(x^2) / c + eps), the operations of HF transformers' LlamaRMSNorm in float32
 * (its mean differs from this sum only in summation order). out may be x. Returns 0; -1 for
 * c < 1. */
int mi_rmsnorm(const float *x, int64_t m, int64_t c, const float *w, float eps, float *out) {
    if (c < 1 || m < 0) return -1;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * c;
        float r = 1.0f / sqrtf(dot_f32(xr, xr, c) / (float)c + eps);
        float *o = out + i * c;
        for (int64_t j = 0; j < c; j++) o[j] = w[j] * (xr[j] * r);
    }
    return 0;
}

/* Rotate-half RoPE (Su et al. 2021; HF's apply_rotary_pos_emb) of x (rows, heads, d)
 * contiguous, row i at table row i % t of cos and sin (t, r) contiguous: for j < r, with
 * h = r / 2, out[j] = x[j] * cos[j] + rot[j] * sin[j], rot[j] = -x[j + h] (j < h) or x[j - h];
 * dimensions j >= r (partial rotary) are copied. The same three float32 roundings as torch's
 * x * cos + rotate_half(x) * sin, so the result equals it bit for bit. out must not be x.
 * Returns 0; -1 for an odd r, r > d or t < 1. */
int mi_rope(const float *x, int64_t rows, int64_t heads, int64_t d, int64_t t, const float *cos,
            const float *sin, int64_t r, float *out) {
    if (r % 2 || r > d || r < 0 || t < 1 || rows < 0 || heads < 0) return -1;
    int64_t h = r / 2;
    for (int64_t i = 0; i < rows; i++) {
        const float *c = cos + (i % t) * r, *s = sin + (i % t) * r;
        for (int64_t g = 0; g < heads; g++) {
            const float *xv = x + (i * heads + g) * d;
            float *o = out + (i * heads + g) * d;
            for (int64_t j = 0; j < h; j++) {
                float a = xv[j] * c[j], b = -xv[j + h] * s[j];
                o[j] = a + b;
            }
            for (int64_t j = h; j < r; j++) {
                float a = xv[j] * c[j], b = xv[j - h] * s[j];
                o[j] = a + b;
            }
            for (int64_t j = r; j < d; j++) o[j] = xv[j];
        }
    }
    return 0;
}

/* One query's attention: o (d,) = softmax(scale * q . k_j) @ v_j over keys j in [lo, hi), with
 * sc a scratch of hi - lo floats. Two passes (scores and their max, then exp and the weighted
 * sum of values), each in key order. NaN anywhere gives NaN out. */
static void attend_one(const float *q, const float *k, int64_t kss, const float *v, int64_t vss, int64_t lo,
                       int64_t hi, int64_t d, float scale, float *sc, float *o) {
    float mx = -INFINITY;
    for (int64_t j = lo; j < hi; j++) {
        float s = dot_f32(q, k + j * kss, d) * scale;
        sc[j - lo] = s;
        mx = s > mx || s != s ? s : mx;
    }
    float sum = 0;
    for (int64_t j = 0; j < hi - lo; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    for (int64_t e = 0; e < d; e++) o[e] = 0;
    for (int64_t j = lo; j < hi; j++) {
        const float *vj = v + j * vss, p = sc[j - lo];
        for (int64_t e = 0; e < d; e++) o[e] += p * vj[e];
    }
    for (int64_t e = 0; e < d; e++) o[e] /= sum;
}

/* Causal grouped-query attention of T new queries over the S = start + T cached keys:
 * q (B, H, T, D) at element strides qs = (batch, head, position), k and v (B, Hkv, S, D) at
 * strides ks and vs, each with unit stride along D; head h reads key/value head
 * h / (H / Hkv). The query at position p = start + t sees keys j <= p, and with window > 0
 * only j > p - window (a sliding window). out (B, H, T, D) contiguous. Each query is computed
 * alone (attend_one), so its result does not depend on T or on the thread count.
 * Returns 0; -1 for inconsistent sizes (S != start + T, H not a multiple of Hkv); -2 when the
 * scratch for the scores cannot be had. */
int mi_attention(const float *q, const int64_t *qs, const float *k, const int64_t *ks, const float *v,
                 const int64_t *vs, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 int64_t start, int64_t window, float scale, float *out, int nthreads) {
    if (B < 0 || T < 0 || D < 1 || Hkv < 1 || H % Hkv || start < 0 || S != start + T || window < 0) return -1;
    int64_t tasks = B * H * T, group = H / Hkv;
    int failed = 0;
    int nt = tasks > 1 && tasks * S * D >= ATTN_PARALLEL_WORK ? nthreads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *sc = (float *)malloc((size_t)(S > 0 ? S : 1) * sizeof(float));
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            if (!sc) continue;
            int64_t b = i / (H * T), h = (i / T) % H, t = i % T, p = start + t, hk = h / group;
            int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            attend_one(q + b * qs[0] + h * qs[1] + t * qs[2], k + b * ks[0] + hk * ks[1], ks[2],
                       v + b * vs[0] + hk * vs[1], vs[2], lo, p + 1, D, scale, sc, out + i * D);
        }
        free(sc);
    }
    return failed ? -2 : 0;
}

/* SwiGLU's product (Shazeer 2020, "GLU variants improve transformer"): out = silu(g) * u with
 * silu(g) = g / (1 + exp(-g)), elementwise over n floats, in float32 (libm's expf). out may be
 * g or u. Returns 0. */
int mi_swiglu(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float s = g[i] / (1.0f + expf(-g[i]));
        out[i] = s * u[i];
    }
    return 0;
}

/* ------------------------------------------------------------------ one whole layer */

/* gguf_blocks.c: products of one input with up to 4 weights stored as GGUF blocks. */
int mi_matmul_many(int act_bits, int nt, const int *types, const uint8_t *const *ws, const int64_t *ns,
                   const float *const *biases, int64_t k, const float *x, int64_t m, float *y, int nthreads);

/* One mi_matmul_many call's weights, as its arguments (k: the input width); act_bits 0:
 * float32 weight rows (see product). */
struct mi_product {
    int act_bits, nt;
    const int *types;
    const uint8_t *const *ws;
    const int64_t *ns;
    const float *const *biases;
    int64_t k;
};

/* A Llama-family pre-norm decoder layer (Llama, Qwen2, SmolLM2, Mistral): q/k/v (with their
 * biases, if any), o, gate/up and down as GGUF-block or float32 products; the two RMSNorm weights
 * (hidden,) and their eps; hidden width C, H query heads and Hkv key/value heads of width D,
 * the attention scale, and window 0 or a sliding window. */
struct mi_layer {
    struct mi_product qkv, o, gate_up, down;
    const float *norm_in, *norm_post;
    float eps, scale;
    int64_t hidden, heads, kv_heads, head_dim, inter, window;
};

/* gguf_blocks.c: a float32 product of a few rows (the f32 precision's kernel). */
int mi_matmul_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads);

/* y = x (m, k) @ W_t^T (+ b_t) for each weight of p, as mi_matmul_many lays them out: (m, n_t)
 * blocks one after another. act_bits 0 marks float32 weights (ws: (n_t, k) float32 rows): one
 * mi_matmul_f32 per weight, then the bias added, as the f32 precision's linear does. */
static int product(const struct mi_product *p, const float *x, int64_t m, float *y, int nthreads) {
    if (p->act_bits != 0)
        return mi_matmul_many(p->act_bits, p->nt, p->types, p->ws, p->ns, p->biases, p->k, x, m, y, nthreads);
    for (int t = 0; t < p->nt; t++) {
        int64_t n = p->ns[t];
        if (mi_matmul_f32((const float *)p->ws[t], n, p->k, x, m, y, nthreads)) return -1;
        const float *b = p->biases ? p->biases[t] : NULL;
        if (b)
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++) y[i * n + j] = y[i * n + j] + b[j];
        y += m * n;
    }
    return 0;
}

/* Floats of scratch mi_layer_step needs for t positions. */
static int64_t layer_scratch(const struct mi_layer *L, int64_t t) {
    int64_t C = L->hidden, HD = L->heads * L->head_dim, KD = L->kv_heads * L->head_dim;
    int64_t attn = (HD + 2 * KD) + (HD + KD) + 2 * (HD > C ? HD : C), mlp = 3 * L->inter + C;
    return t * (C + (attn > mlp ? attn : mlp));
}

/* x += o(attention(rope(q), rope(k) and v written into the cache)) for h = norm(x) (t, C);
 * kc, vc: (Hkv, cap, D). s: scratch. Each step is the function the separate path calls. */
static int attention_half(const struct mi_layer *L, float *x, const float *h, int64_t t, const float *cos,
                          const float *sin, int64_t r, float *kc, float *vc, int64_t cap, int64_t start,
                          float *s, int nthreads) {
    int64_t H = L->heads, Hkv = L->kv_heads, D = L->head_dim, C = L->hidden, HD = H * D;
    float *q = s, *k = q + t * HD, *v = k + t * Hkv * D;  /* (t, n) blocks of the product */
    float *qr = v + t * Hkv * D, *kr = qr + t * HD;        /* after RoPE: (t, H, D), (t, Hkv, D) */
    float *att = kr + t * Hkv * D, *y = att + t * (HD > C ? HD : C); /* (H, t, D); o's (t, C) */
    int rc = product(&L->qkv, h, t, q, nthreads);
    if (rc) return rc;
    if (mi_rope(q, t, H, D, t, cos, sin, r, qr) || mi_rope(k, t, Hkv, D, t, cos, sin, r, kr)) return -1;
    for (int64_t i = 0; i < t; i++)
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t e = 0; e < D; e++) {
                kc[(g * cap + start + i) * D + e] = kr[(i * Hkv + g) * D + e];
                vc[(g * cap + start + i) * D + e] = v[(i * Hkv + g) * D + e];
            }
    const int64_t qs[3] = {0, D, HD}, cs[3] = {0, cap * D, D};
    rc = mi_attention(qr, qs, kc, cs, vc, cs, 1, H, Hkv, t, start + t, D, start, L->window, L->scale, att, nthreads);
    if (rc) return rc;
    for (int64_t i = 0; i < t; i++) /* (H, t, D) -> (t, H * D), into q's space */
        for (int64_t g = 0; g < H; g++)
            for (int64_t e = 0; e < D; e++) q[(i * H + g) * D + e] = att[(g * t + i) * D + e];
    rc = product(&L->o, q, t, y, nthreads);
    if (rc) return rc;
    for (int64_t i = 0; i < t * C; i++) x[i] = x[i] + y[i];
    return 0;
}

/* x += down(silu(gate(h)) * up(h)) for h = norm(x) (t, C). s: scratch. */
static int mlp_half(const struct mi_layer *L, float *x, const float *h, int64_t t, float *s, int nthreads) {
    int64_t I = L->inter, C = L->hidden;
    float *gu = s, *a = gu + 2 * t * I, *y = a + t * I; /* gate (t, I) then up (t, I); silu * up; down's */
    int rc = product(&L->gate_up, h, t, gu, nthreads);
    if (rc) return rc;
    mi_swiglu(gu, gu + t * I, t * I, a);
    rc = product(&L->down, a, t, y, nthreads);
    if (rc) return rc;
    for (int64_t i = 0; i < t * C; i++) x[i] = x[i] + y[i];
    return 0;
}

/* One decoder layer over t new positions of one sequence, in place on x (t, C) float32:
 * h = x + attention(norm_in(x)), then x = h + mlp(norm_post(h)), writing the new keys and
 * values at positions start .. start + t - 1 of kc, vc (Hkv, cap, D) float32 (the positions
 * before hold the sequence's earlier keys). cos, sin: (t, r) for the t positions.
 * The same functions in the same order as the layer computed one operation at a time
 * (mi_rmsnorm, mi_matmul_many, mi_rope, mi_attention, mi_swiglu, float32 adds), so the result
 * is equal bit for bit; one call instead of about twenty.
 * Returns 0; -1 for sizes that do not fit (start + t > cap, an odd r, ...) or what
 * mi_matmul_many refuses; -2 when scratch memory cannot be had. x may be partly updated on
 * an error. */
int mi_layer_step(const struct mi_layer *L, float *x, int64_t t, const float *cos, const float *sin, int64_t r,
                  float *kc, float *vc, int64_t cap, int64_t start, int nthreads) {
    if (t < 1 || start < 0 || start + t > cap || L->kv_heads < 1 || L->heads < 1 || L->head_dim < 1 ||
        L->heads % L->kv_heads || r > L->head_dim || r % 2)
        return -1;
    float *h = (float *)malloc((size_t)layer_scratch(L, t) * sizeof(float));
    if (!h) return -2;
    float *s = h + t * L->hidden;
    int rc = mi_rmsnorm(x, t, L->hidden, L->norm_in, L->eps, h);
    if (!rc) rc = attention_half(L, x, h, t, cos, sin, r, kc, vc, cap, start, s, nthreads);
    if (!rc) rc = mi_rmsnorm(x, t, L->hidden, L->norm_post, L->eps, h);
    if (!rc) rc = mlp_half(L, x, h, t, s, nthreads);
    free(h);
    return rc;
}
