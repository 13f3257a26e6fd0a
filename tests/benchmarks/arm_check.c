/* The C kernels on another CPU: this program feeds meshinfer/engine/kernels' functions fixed
 * pseudo-random inputs (with the hostile values a peer may send: huge, subnormal, zero, inf and
 * NaN activations) and prints one FNV-1a hash per result. Built for this machine (AVX2) and for
 * aarch64 (run under qemu-user), the two printouts must be equal: the NEON path (and the plain C
 * one) gives the AVX2 path's bits. tests/benchmarks/arm_check.sh builds and compares them.
 *
 * NaN results are hashed as one canonical NaN: which NaN an operation returns depends on its
 * operands' order in the instruction, not on the values.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int mi_dequantize(int type, const uint8_t *w, int64_t n, int64_t k, float *out, int nthreads);
int mi_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads);
int mi_matmul_q8(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads);
int mi_matmul_q16(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads);
int mi_matmul_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads);
int mi_round_activations(const float *x, int64_t m, int64_t k, int bits, float *out, int nthreads);
int mi_supports_q8(int type);
int mi_simd(void);
int mi_rmsnorm(const float *x, int64_t m, int64_t c, const float *w, float eps, float *out);
int mi_rope(const float *x, int64_t T, int64_t H, int64_t D, int64_t R, const float *cos, const float *sin,
            int64_t rot, float *out);
int mi_attention(const float *q, const int64_t *qs, const float *k, const int64_t *ks, const float *v,
                 const int64_t *vs, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 int64_t start, int64_t window, float scale, float *out, int nthreads);
int mi_swiglu(const float *gate, const float *up, int64_t n, float *out);

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next(void) { /* xorshift64* (Vigna 2016) */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float gauss(void) { /* about N(0, 1): the sum of 4 uniforms, centred and scaled */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)next() / 4294967296.0f;
    return (s - 2.0f) * 1.7320508f;
}

static void report(const char *name, const float *y, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, y + i, 4);
        if (y[i] != y[i]) bits = 0x7FC00000u;
        for (int b = 0; b < 4; b++) h = (h ^ ((bits >> (8 * b)) & 0xFF)) * 1099511628211ull;
    }
    printf("%-28s %016llx\n", name, (unsigned long long)h);
}

/* (type id, weights per block, bytes per block, offsets of its float16 fields) */
static const struct { const char *name; int type, qk, bytes, halves[2]; } TYPES[] = {
    {"F16", 1, 32, 64, {-1, -1}},   {"Q4_0", 2, 32, 18, {0, -1}},  {"Q4_1", 3, 32, 20, {0, 2}},
    {"Q5_0", 6, 32, 22, {0, -1}},   {"Q8_0", 8, 32, 34, {0, -1}},  {"Q4_K", 12, 256, 144, {0, 2}},
    {"Q6_K", 14, 256, 210, {208, -1}},
};

static uint16_t small_half(void) { /* a finite float16 of magnitude 2^-10 .. 2^-1, either sign */
    return (uint16_t)((next() & 0x83FF) | ((5 + next() % 10) << 10));
}

static void hostile(float *x, int64_t m, int64_t k) {
    for (int64_t i = 0; i < m * k; i++) x[i] = gauss();
    for (int j = 32; j < 64; j++) x[j] *= 1e30f;
    for (int j = 64; j < 96; j++) x[j] *= 1e-40f; /* subnormal: 1 / scale overflows */
    for (int j = 96; j < 128; j++) x[j] = 0;
    if (m > 1) {
        for (int j = 0; j < 32; j++) x[k + j] = (float)j - 15.5f; /* halves */
        x[k + 40] = INFINITY;
        x[k + 70] = NAN;
    }
}

int main(void) {
    const int64_t n = 37, k = 512, rows[3] = {1, 3, 17};
    char name[64];
    printf("simd %d\n", mi_simd());
    for (size_t t = 0; t < sizeof(TYPES) / sizeof(TYPES[0]); t++) {
        int64_t nb = k / TYPES[t].qk, row_bytes = nb * TYPES[t].bytes;
        uint8_t *w = malloc((size_t)(n * row_bytes));
        for (int64_t i = 0; i < n * row_bytes; i++) w[i] = (uint8_t)next();
        for (int64_t b = 0; b < n * nb; b++) {
            uint8_t *blk = w + b * TYPES[t].bytes;
            if (TYPES[t].type == 1) { /* F16: every value a finite half */
                for (int j = 0; j < 32; j++) {
                    uint16_t h = small_half();
                    memcpy(blk + 2 * j, &h, 2);
                }
            }
            for (int f = 0; f < 2; f++)
                if (TYPES[t].halves[f] >= 0) {
                    uint16_t h = small_half();
                    memcpy(blk + TYPES[t].halves[f], &h, 2);
                }
        }
        float *deq = malloc((size_t)(n * k) * sizeof(float));
        mi_dequantize(TYPES[t].type, w, n, k, deq, 2);
        snprintf(name, sizeof name, "%s dequantize", TYPES[t].name);
        report(name, deq, (size_t)(n * k));
        for (int r = 0; r < 3; r++) {
            int64_t m = rows[r];
            float *x = malloc((size_t)(m * k) * sizeof(float)), *y = malloc((size_t)(m * n) * sizeof(float));
            hostile(x, m, k);
            mi_matmul(TYPES[t].type, w, n, k, x, m, y, 2);
            snprintf(name, sizeof name, "%s f32 x%lld", TYPES[t].name, (long long)m);
            report(name, y, (size_t)(m * n));
            if (mi_supports_q8(TYPES[t].type)) {
                mi_matmul_q16(TYPES[t].type, w, n, k, x, m, y, 2);
                snprintf(name, sizeof name, "%s int16 x%lld", TYPES[t].name, (long long)m);
                report(name, y, (size_t)(m * n));
                mi_matmul_q8(TYPES[t].type, w, n, k, x, m, y, 2);
                snprintf(name, sizeof name, "%s int8 x%lld", TYPES[t].name, (long long)m);
                report(name, y, (size_t)(m * n));
            }
            free(x), free(y);
        }
        free(w), free(deq);
    }
    { /* float32 rows: mi_matmul_f32 (the f32 precision; types the block kernels do not take) */
        static float w32[37 * 512], x32[24 * 512], y32[24 * 37];
        for (int i = 0; i < 37 * 512; i++) w32[i] = gauss();
        const int64_t f32rows[4] = {1, 3, 17, 24};
        for (int r = 0; r < 4; r++) {
            hostile(x32, f32rows[r], 512);
            mi_matmul_f32(w32, 37, 512, x32, f32rows[r], y32, 2);
            snprintf(name, sizeof name, "F32 rows x%lld", (long long)f32rows[r]);
            report(name, y32, (size_t)(f32rows[r] * 37));
        }
    }
    float x[3 * 512], out[3 * 512];
    hostile(x, 3, 512);
    for (int bits = 8; bits <= 16; bits += 8) {
        mi_round_activations(x, 3, 512, bits, out, 2);
        snprintf(name, sizeof name, "round int%d", bits);
        report(name, out, 3 * 512);
    }
    /* step operations: RMSNorm, RoPE, attention over a 40-position cache, SwiGLU */
    float g[6 * 64], nw[64], o[6 * 64];
    for (int i = 0; i < 6 * 64; i++) g[i] = 3 * gauss();
    for (int i = 0; i < 64; i++) nw[i] = gauss();
    mi_rmsnorm(g, 6, 64, nw, 1e-6f, o);
    report("rmsnorm", o, 6 * 64);
    float q[3 * 4 * 16], cs[3 * 16], sn[3 * 16], r[3 * 4 * 16];
    for (int i = 0; i < 3 * 4 * 16; i++) q[i] = gauss();
    for (int i = 0; i < 3 * 16; i++) cs[i] = gauss(), sn[i] = gauss(); /* not cosf: its rounding is the libm's */
    mi_rope(q, 3, 4, 16, 3, cs, sn, 16, r);
    report("rope", r, 3 * 4 * 16);
    static float kk[2 * 40 * 16], vv[2 * 40 * 16], att[4 * 3 * 16];
    for (int i = 0; i < 2 * 40 * 16; i++) kk[i] = gauss(), vv[i] = gauss();
    const int64_t qs[3] = {4 * 3 * 16, 3 * 16, 16}, ks[3] = {2 * 40 * 16, 40 * 16, 16};
    mi_attention(q, qs, kk, ks, vv, ks, 1, 4, 2, 3, 40, 16, 37, 0, 0.25f, att, 2);
    report("attention", att, 4 * 3 * 16);
    float up[6 * 64];
    for (int i = 0; i < 6 * 64; i++) up[i] = gauss();
    mi_swiglu(g, up, 6 * 64, o);
    report("swiglu", o, 6 * 64);
    return 0;
}
