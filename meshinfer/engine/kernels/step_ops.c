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

/* a . b over n floats: 8-lane FMA accumulation where n is a multiple of 8 (AVX2), a scalar
 * sum otherwise. The order is fixed per call site, never by the caller's row count. */
static float dot_f32(const float *a, const float *b, int64_t n) {
#ifdef MI_STEP_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
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
