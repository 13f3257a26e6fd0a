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
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
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

/* Query task i (of B * H * T, in (b, h, t) order) of mi_attention's arguments, with sc a
 * scratch of S floats. */
static void attend_task(int64_t i, const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                        const float *v, const int64_t *vs, int64_t H, int64_t Hkv, int64_t T, int64_t D,
                        int64_t start, int64_t window, float scale, float *out, float *sc) {
    int64_t b = i / (H * T), h = (i / T) % H, t = i % T, p = start + t, hk = h / (H / Hkv);
    int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    attend_one(q + b * qs[0] + h * qs[1] + t * qs[2], k + b * ks[0] + hk * ks[1], ks[2], v + b * vs[0] + hk * vs[1],
               vs[2], lo, p + 1, D, scale, sc, out + i * D);
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
    int64_t tasks = B * H * T;
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
        for (int64_t i = 0; i < tasks; i++)
            if (sc) attend_task(i, q, qs, k, ks, v, vs, H, Hkv, T, D, start, window, scale, out, sc);
        free(sc);
    }
    return failed ? -2 : 0;
}

/* Whether every one of n floats is finite (neither NaN nor an infinity: an exponent that is not
 * all ones), 1 or 0. Why: torch.isfinite(x).all() over a step's 151,936 logits took 1.7 ms at 2
 * threads here (0.5 ms at one), 3 ms of a 40 ms decode step on the last hop in a split
 * (py-spy, 2026-12-03); this loop, which the compiler vectorizes, takes tens of microseconds. */
int mi_all_finite(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        bad |= (b & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* The index of the largest of n floats, the first on ties, as torch.argmax picks it: the first
 * NaN's when there is a NaN (torch orders NaN above every number); 0 for n <= 1. Why: torch's
 * argmax over a step's 151,936 logits took 0.22 ms at 2 threads here, against 0.02 ms for its
 * max (2026-12-04). Two passes: the largest value (and whether there is a NaN), then the first
 * index holding it, 8 values a compare with AVX2. */
int64_t mi_argmax(const float *x, int64_t n) {
    if (n <= 1) return 0;
    int64_t i = 0;
    float m = x[0];
    int nan = 0;
#ifdef MI_STEP_AVX2
    __m256 vm = _mm256_set1_ps(x[0]), vnan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    i = 0;
    if (nan) {
        while (x[i] == x[i]) i++;
        return i;
    }
#ifdef MI_STEP_AVX2
    const __m256 vm8 = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm8, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    while (x[i] != m) i++;
    return i;
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

/* gguf_blocks.c: the products' forms for a thread team (see mi_team_matmul_many there). */
int mi_team_check(int act_bits, int nt, const int *types, const int64_t *ns, int64_t k);
void mi_team_matmul_many(int act_bits, int nt, const int *types, const uint8_t *const *ws, const int64_t *ns,
                         const float *const *biases, int64_t k, const float *x, int64_t m, float *y, void *q,
                         float *d, float *s);
void mi_team_matmul_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y);

/* One product's weights: mi_matmul_many's arguments (k: the input width); act_bits 0: float32
 * weight rows (ws: (n_t, k) float32), multiplied as mi_matmul_f32 does, then the bias added. */
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

/* Memory a team shares: the layer's normed input h (t, C) and its other intermediates s; the
 * rounded activations of the widest product input (q, d, sd: see mi_team_matmul_many); and
 * each thread's attention scores (S floats from scores + thread * S). */
struct team_memory {
    float *h, *s, *d, *sd, *scores;
    void *q;
    int64_t S;
};

static int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Floats of intermediates one layer needs for t positions (after h). */
static int64_t layer_scratch(const struct mi_layer *L, int64_t t) {
    int64_t C = L->hidden, HD = L->heads * L->head_dim, KD = L->kv_heads * L->head_dim;
    int64_t attn = (HD + 2 * KD) + (HD + KD) + 2 * (HD > C ? HD : C), mlp = 3 * L->inter + C;
    return t * (attn > mlp ? attn : mlp);
}

/* Whether p multiplies an input of width k into nt outputs of widths ns, with weights the team
 * products take. Returns 0, or -1. */
static int product_check(const struct mi_product *p, int64_t k, int nt, const int64_t *ns) {
    if (p->k != k || p->nt != nt) return -1;
    for (int t = 0; t < nt; t++)
        if (p->ns[t] != ns[t]) return -1;
    if (p->act_bits == 0) return k % 8 ? -1 : 0;
    return mi_team_check(p->act_bits, nt, p->types, p->ns, k);
}

/* Whether L's sizes fit together, with a rotary width r. Returns 0, or -1. */
static int layer_check(const struct mi_layer *L, int64_t r) {
    int64_t C = L->hidden, I = L->inter, HD = L->heads * L->head_dim, KD = L->kv_heads * L->head_dim;
    if (C < 1 || I < 1 || L->kv_heads < 1 || L->heads < 1 || L->head_dim < 1 || L->heads % L->kv_heads ||
        r > L->head_dim || L->window < 0)
        return -1;
    const int64_t qkv[3] = {HD, KD, KD}, gate_up[2] = {I, I};
    return product_check(&L->qkv, C, 3, qkv) || product_check(&L->o, HD, 1, &C) ||
           product_check(&L->gate_up, C, 2, gate_up) || product_check(&L->down, I, 1, &C) ? -1 : 0;
}

/* y = x (m, k) @ W_t^T (+ b_t) for each weight of p, laid out as mi_matmul_many lays them:
 * (m, n_t) blocks one after another. Called by every thread of the team; ends with a barrier. */
static void team_product(const struct mi_product *p, const float *x, int64_t m, float *y, const struct team_memory *w) {
    if (p->act_bits != 0) {
        mi_team_matmul_many(p->act_bits, p->nt, p->types, p->ws, p->ns, p->biases, p->k, x, m, y, w->q, w->d, w->sd);
        return;
    }
    for (int t = 0; t < p->nt; t++) {
        int64_t n = p->ns[t];
        mi_team_matmul_f32((const float *)p->ws[t], n, p->k, x, m, y);
        const float *b = p->biases ? p->biases[t] : NULL;
        if (b) {
#pragma omp single
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++) y[i * n + j] = y[i * n + j] + b[j];
        }
        y += m * n;
    }
}

/* x += o(attention(rope(q), rope(k) and v written into the cache)) for w->h = norm(x) (t, C);
 * kc, vc: (Hkv, cap, D). The functions the separate path calls, in its order. */
static void team_attention_half(const struct mi_layer *L, float *x, int64_t t, const float *cos, const float *sin,
                                int64_t r, float *kc, float *vc, int64_t cap, int64_t start,
                                const struct team_memory *w) {
    int64_t H = L->heads, Hkv = L->kv_heads, D = L->head_dim, C = L->hidden, HD = H * D;
    float *q = w->s, *k = q + t * HD, *v = k + t * Hkv * D; /* (t, n) blocks of the product */
    float *qr = v + t * Hkv * D, *kr = qr + t * HD;          /* after RoPE: (t, H, D), (t, Hkv, D) */
    float *att = kr + t * Hkv * D, *y = att + t * (HD > C ? HD : C); /* (H, t, D); o's (t, C) */
    team_product(&L->qkv, w->h, t, q, w);
#pragma omp single
    {
        mi_rope(q, t, H, D, t, cos, sin, r, qr);
        mi_rope(k, t, Hkv, D, t, cos, sin, r, kr);
        for (int64_t i = 0; i < t; i++)
            for (int64_t g = 0; g < Hkv; g++)
                for (int64_t e = 0; e < D; e++) {
                    kc[(g * cap + start + i) * D + e] = kr[(i * Hkv + g) * D + e];
                    vc[(g * cap + start + i) * D + e] = v[(i * Hkv + g) * D + e];
                }
    }
    const int64_t qs[3] = {0, D, HD}, cs[3] = {0, cap * D, D};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < H * t; i++)
        attend_task(i, qr, qs, kc, cs, vc, cs, H, Hkv, t, D, start, L->window, L->scale, att,
                    w->scores + thread_num() * w->S);
#pragma omp single
    for (int64_t i = 0; i < t; i++) /* (H, t, D) -> (t, H * D), into q's space */
        for (int64_t g = 0; g < H; g++)
            for (int64_t e = 0; e < D; e++) q[(i * H + g) * D + e] = att[(g * t + i) * D + e];
    team_product(&L->o, q, t, y, w);
#pragma omp single
    for (int64_t i = 0; i < t * C; i++) x[i] = x[i] + y[i];
}

/* Floats of SwiGLU one thread takes at a time. */
#define SWIGLU_PART 1024

/* x += down(silu(gate(h)) * up(h)) for w->h = norm(x) (t, C). */
static void team_mlp_half(const struct mi_layer *L, float *x, int64_t t, const struct team_memory *w) {
    int64_t I = L->inter, C = L->hidden, n = t * I;
    float *gu = w->s, *a = gu + 2 * n, *y = a + n; /* gate (t, I) then up (t, I); silu * up; down's */
    team_product(&L->gate_up, w->h, t, gu, w);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (n + SWIGLU_PART - 1) / SWIGLU_PART; c++) {
        int64_t lo = c * SWIGLU_PART, len = n - lo < SWIGLU_PART ? n - lo : SWIGLU_PART;
        mi_swiglu(gu + lo, gu + n + lo, len, a + lo);
    }
    team_product(&L->down, a, t, y, w);
#pragma omp single
    for (int64_t i = 0; i < t * C; i++) x[i] = x[i] + y[i];
}

/* Layers layers[0 .. n - 1] of a Llama-family model, one after another, over t new positions
 * of one sequence, in place on x (t, C) float32: for each, h = x + attention(norm_in(x)), then
 * x = h + mlp(norm_post(h)), writing the new keys and values at positions start .. start + t - 1
 * of kcs[l], vcs[l] (Hkv, cap, D) float32 (the positions before hold the sequence's earlier
 * keys). cos, sin: (t, r) for the t positions.
 * The same functions in the same order as the layers computed one operation at a time
 * (mi_rmsnorm, mi_matmul_many, mi_rope, mi_attention, mi_swiglu, float32 adds), each output row
 * and each query computed alone, so the result is equal bit for bit whatever the thread count.
 * All of it runs in one OpenMP parallel region of nthreads threads, which share out each
 * product's rows and the attention's queries and meet at a barrier after each operation: a
 * decode step starts one team instead of about 120 (docs/performance.md, "One team per step").
 * Everything is checked and allocated before the team starts, so nothing inside can fail.
 * Returns 0; -1 for sizes that do not fit (start + t > cap, an odd r, products of other widths,
 * block types a mode does not take, ...); -2 when memory cannot be had. */
int mi_layers_step(const struct mi_layer *const *layers, int64_t n, float *x, int64_t t, const float *cos,
                   const float *sin, int64_t r, float *const *kcs, float *const *vcs, int64_t cap, int64_t start,
                   int nthreads) {
    if (n < 1 || t < 1 || start < 0 || start + t > cap || r < 0 || r % 2 || nthreads < 1) return -1;
    int64_t C = layers[0]->hidden, scratch = 0, widest = 0;
    for (int64_t l = 0; l < n; l++) {
        const struct mi_layer *L = layers[l];
        if (layer_check(L, r) || L->hidden != C) return -1;
        int64_t s = layer_scratch(L, t), k = L->inter > L->heads * L->head_dim ? L->inter : L->heads * L->head_dim;
        scratch = s > scratch ? s : scratch;
        widest = k > widest ? k : widest;
    }
    widest = widest > C ? widest : C;
    struct team_memory w;
    w.S = start + t;
    w.h = (float *)malloc((size_t)(t * C + scratch + 2 * t * (widest / 32) + nthreads * w.S) * sizeof(float));
    w.q = malloc((size_t)(t * widest) * 2);
    if (!w.h || !w.q) {
        free(w.h), free(w.q);
        return -2;
    }
    w.s = w.h + t * C;
    w.d = w.s + scratch;
    w.sd = w.d + t * (widest / 32);
    w.scores = w.sd + t * (widest / 32);
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < n; l++) {
        const struct mi_layer *L = layers[l];
#pragma omp single
        mi_rmsnorm(x, t, C, L->norm_in, L->eps, w.h);
        team_attention_half(L, x, t, cos, sin, r, kcs[l], vcs[l], cap, start, &w);
#pragma omp single
        mi_rmsnorm(x, t, C, L->norm_post, L->eps, w.h);
        team_mlp_half(L, x, t, &w);
    }
    free(w.h), free(w.q);
    return 0;
}

/* One decoder layer: mi_layers_step of the one layer L, with its cache kc, vc (Hkv, cap, D),
 * and its return codes. */
int mi_layer_step(const struct mi_layer *L, float *x, int64_t t, const float *cos, const float *sin, int64_t r,
                  float *kc, float *vc, int64_t cap, int64_t start, int nthreads) {
    return mi_layers_step(&L, 1, x, t, cos, sin, r, &kc, &vc, cap, start, nthreads);
}
