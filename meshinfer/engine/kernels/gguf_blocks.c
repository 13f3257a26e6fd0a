/* Products straight from a GGUF file's quantized blocks, with float32 activations.
 *
 * meshinfer's "gguf" precision keeps every projection as the file stores it (Q4_K, Q5_0, Q6_K,
 * Q8_0, Q4_0, Q4_1, or float32 rows) and computes y = x @ W^T from those bytes:
 * each block is dequantized into a small float32 buffer (in L1) exactly as gguf-py's
 * gguf.quants does it (same float32 operations in the same order, so the weights equal its
 * dequantization bit for bit: tests/test_gguf_kernels.py), then multiplied into every input row.
 *
 * Block layouts and formulas: ggml's ggml-common.h / ggml-quants.c (dequantize_row_*), as
 * gguf-py transcribes them (gguf/quants.py).
 *
 * Build (meshinfer/engine/kernels/native.py): cc -O3 -march=native -fopenmp -ffp-contract=off
 * -shared -fPIC. fp-contract=off keeps a*b - c from being fused into one rounding, which would
 * change the dequantized weight; the dot products use explicit FMA where the CPU has it.
 * Threads: OpenMP over output rows, num_threads given by the caller (torch's thread count).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MI_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* Arm (Apple silicon, Graviton): the portable path's inner loops in NEON, the same operations
 * lane for lane (tests/benchmarks/arm_check.sh compares its bits with the AVX2 build's). */
#include <arm_neon.h>
#define MI_NEON 1
#endif

/* VNNI (AVX512-VNNI with AVX512VL: Intel Ice Lake and later servers, AMD Zen 4 and later; or
 * AVX-VNNI: Intel Alder Lake and later): the integer dot products' instructions that sum four
 * u8 x s8 products (vpdpbusd), or two s16 x s16 products plus an accumulator (vpdpwssd), into
 * each int32 lane in one instruction, in the AVX2 path's 256-bit registers. They replace AVX2's
 * maddubs + madd pairs exactly: the int32 lanes hold the same integers (maddubs's int16 pair
 * sums cannot saturate here: |u8| <= 128 against |s8| <= 127, or nibbles against int8), so every
 * float32 operation after them, and every result, keeps its bits. llama.cpp's x86 path makes the
 * same substitution (ggml-cpu's mul_sum_us8_pairs_float). Q6_K's int8 products keep maddubs +
 * madd, whose madd applies the 16-weight scales (VNNI would need a slow 32-bit multiply there).
 * Registers stay 256-bit: two blocks of a row per 512-bit register would add the blocks'
 * products into the accumulator lanes in another order, and so change the bits. A test build on
 * a CPU without VNNI defines MI_VNNI_EMULATION and mi_dpbusd / mi_dpwssd itself (-include of an
 * emulation header: tests/helpers/vnni_emulation.h, tests/benchmarks/vnni_check.sh). */
#if defined(MI_AVX2) && defined(MI_VNNI_EMULATION)
#define MI_VNNI 2
#elif defined(MI_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MI_VNNI 1
static inline __m256i mi_dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
static inline __m256i mi_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(MI_AVX2) && defined(__AVXVNNI__)
#define MI_VNNI 1
static inline __m256i mi_dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
static inline __m256i mi_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif

/* GGML type ids (ggml.h, enum ggml_type). */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

/* Input rows handled per pass over a weight row (a verification step has at most this many). */
#define MAX_ROWS 16
/* Output rows a thread takes at a time. */
#define ROWS_PER_CHUNK 64

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef __F16C__
#include <immintrin.h>
/* The hardware conversion (F16C, on every AVX2 CPU): exact, as half_to_float, and without its
 * branches; it runs once per block in the kernels' inner loops. */
static inline float rd_half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float rd_half(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }
#endif

/* How far ahead of the block in use the kernels ask for the weights (bytes): one prefetch per
 * 64-byte line of each block, this far on, so that the line is in L1 when the loop reaches it.
 * A prefetch never faults, so one past the end of the weights is harmless. On the 2-core EPYC
 * 1,024 bytes first made the int8 product of the Q8_0 output head 0.89x the time and the down
 * projections' 0.91x; on 2026-12-04, whole gguf-a8 decode steps on one thread took 0.95x the time
 * at 2,048 and 0.92x at 3,072 (with the scales formed in the loop, row1_q32) against 1,024, the
 * lowest of 80 steps in six alternated runs each; 4,096 and 8,192 measured no better on two
 * threads (docs/performance.md, "Prefetch and scale runs" and "Long streams"). */
#define PREFETCH_BYTES 3072
#define PREFETCH_BLOCK(W, BYTES)                                                                  \
    for (int pf_ = 0; pf_ < (BYTES); pf_ += 64) __builtin_prefetch((const char *)(W) + PREFETCH_BYTES + pf_, 0, 3)

/* One block -> its weights, float32. Each returns the number of weights (the block size). */
static int deq_q8_0(const uint8_t *b, float *y) { /* d f16, qs int8[32]: y = q * d */
    float d = rd_half(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) y[i] = (float)q[i] * d;
    return 32;
}

static int deq_q4_0(const uint8_t *b, float *y) { /* d, qs[16]: y = (q - 8) * d */
    float d = rd_half(b);
    const uint8_t *q = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((int)(q[i] & 0xF) - 8);
        y[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
    }
    return 32;
}

static int deq_q4_1(const uint8_t *b, float *y) { /* d, m, qs[16]: y = d * q + m */
    float d = rd_half(b), m = rd_half(b + 2);
    const uint8_t *q = b + 4;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(q[i] & 0xF) + m;
        y[i + 16] = d * (float)(q[i] >> 4) + m;
    }
    return 32;
}

static int deq_q5_0(const uint8_t *b, float *y) { /* d, qh u32, qs[16]: y = d * (q5 - 16) */
    float d = rd_half(b);
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    const uint8_t *q = b + 6;
    for (int i = 0; i < 16; i++) {
        int lo = (q[i] & 0xF) | (((qh >> i) & 1) << 4);
        int hi = (q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        y[i] = d * (float)(lo - 16);
        y[i + 16] = d * (float)(hi - 16);
    }
    return 32;
}

/* Q4_K's 6-bit scale and min of 32-weight group g (0-7) from its 12 scale bytes s. */
static inline void q4k_scale_min(const uint8_t *s, int g, int *sc, int *mn) {
    if (g < 4) {
        *sc = s[g] & 0x3F;
        *mn = s[g + 4] & 0x3F;
    } else {
        *sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 2) & 0x30);
        *mn = (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30);
    }
}

static int deq_q4_k(const uint8_t *b, float *y) {
    /* d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]: group g of 32 weights is
     * (d * sc[g]) * q - (dmin * m[g]); groups 2j / 2j+1 are the low / high nibbles of qs[32j..] */
    float d = rd_half(b), dmin = rd_half(b + 2);
    const uint8_t *s = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++) {
        for (int h = 0; h < 2; h++) {
            int g = 2 * j + h, sc, mn;
            q4k_scale_min(s, g, &sc, &mn);
            float dl = d * (float)sc, ml = dmin * (float)mn;
            float *o = y + 32 * g;
            const uint8_t *qq = q + 32 * j;
            if (h == 0)
                for (int l = 0; l < 32; l++) o[l] = dl * (float)(qq[l] & 0xF) - ml;
            else
                for (int l = 0; l < 32; l++) o[l] = dl * (float)(qq[l] >> 4) - ml;
        }
    }
    return 256;
}

static int deq_q6_k(const uint8_t *b, float *y) {
    /* ql[128], qh[64], scales int8[16], d: weight i of a 128-half is (d * sc[i / 16]) * (q6 - 32) */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = rd_half(b + 208);
    float ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    for (int half = 0; half < 2; half++) {
        const uint8_t *l = ql + 64 * half, *h = qh + 32 * half;
        float *o = y + 128 * half;
        const float *dd = ds + 8 * half;
        for (int i = 0; i < 32; i++) {
            int q1 = ((l[i] & 0xF) | (((h[i] >> 0) & 3) << 4)) - 32;
            int q2 = ((l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4)) - 32;
            int q3 = ((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32;
            int q4 = ((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32;
            o[i] = dd[i / 16] * (float)q1;
            o[i + 32] = dd[2 + i / 16] * (float)q2;
            o[i + 64] = dd[4 + i / 16] * (float)q3;
            o[i + 96] = dd[6 + i / 16] * (float)q4;
        }
    }
    return 256;
}

static int deq_f16(const uint8_t *b, float *y) {
    for (int i = 0; i < 32; i++) y[i] = rd_half(b + 2 * i);
    return 32;
}

static int deq_f32(const uint8_t *b, float *y) {
    memcpy(y, b, 32 * sizeof(float));
    return 32;
}

typedef int (*deq_fn)(const uint8_t *, float *);

/* Per type: weights per block, bytes per block, dequantizer. F32/F16 use 32-weight "blocks". */
static int type_info(int type, int *qk, int *bytes, deq_fn *fn) {
    switch (type) {
    case T_F32: *qk = 32; *bytes = 128; *fn = deq_f32; return 0;
    case T_F16: *qk = 32; *bytes = 64; *fn = deq_f16; return 0;
    case T_Q4_0: *qk = 32; *bytes = 18; *fn = deq_q4_0; return 0;
    case T_Q4_1: *qk = 32; *bytes = 20; *fn = deq_q4_1; return 0;
    case T_Q5_0: *qk = 32; *bytes = 22; *fn = deq_q5_0; return 0;
    case T_Q8_0: *qk = 32; *bytes = 34; *fn = deq_q8_0; return 0;
    case T_Q4_K: *qk = 256; *bytes = 144; *fn = deq_q4_k; return 0;
    case T_Q6_K: *qk = 256; *bytes = 210; *fn = deq_q6_k; return 0;
    default: return -1;
    }
}

/* Whether this build knows `type`: 1 or 0. */
int mi_supports(int type) {
    int qk, bytes;
    deq_fn fn;
    return type_info(type, &qk, &bytes, &fn) == 0;
}

/* The instructions this build's dot products use: 1 AVX2+FMA, 2 NEON (aarch64; the portable
 * path's inner loops, same bits), 0 plain C. */
int mi_simd(void) {
#if defined(MI_AVX2)
    return 1;
#elif defined(MI_NEON)
    return 2;
#else
    return 0;
#endif
}

/* Whether the AVX2 path's integer dot products use VNNI instructions: 1, 2 for a test build that
 * emulates them (MI_VNNI_EMULATION), 0 without (then maddubs + madd; the same bits either way). */
int mi_vnni(void) {
#ifdef MI_VNNI
    return MI_VNNI;
#else
    return 0;
#endif
}

/* Weights (rows x columns) below which mi_dequantize runs on the calling thread: a decode step's
 * embedding row (896 weights, a few microseconds) cost more in waking a second thread than in
 * dequantizing (py-spy put about 1.5% of a gguf-a8 step there, 2026-12-04). */
#define DEQUANTIZE_PARALLEL_WEIGHTS (1 << 16)

/* Dequantize rows [0, n) of a weight of k columns (k a multiple of the block size) into
 * out (n, k) float32. Returns 0, or -1 for an unknown type or a k that is not a multiple. */
int mi_dequantize(int type, const uint8_t *w, int64_t n, int64_t k, float *out, int nthreads) {
    int qk, bytes;
    deq_fn fn;
    if (type_info(type, &qk, &bytes, &fn) || k % qk) return -1;
    int64_t nb = k / qk, row_bytes = nb * bytes;
    if (n * k < DEQUANTIZE_PARALLEL_WEIGHTS) nthreads = 1;
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) fn(w + r * row_bytes + b * bytes, out + r * k + b * qk);
    return 0;
}

#ifdef MI_AVX2
static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
/* The portable path mirrors the AVX2 one operation for operation: 8 float32 lanes, each
 * accumulated with a fused multiply-add (fmaf, as _mm256_fmadd_ps), summed as hsum8 sums them,
 * and the same integer lane sums; so a build without AVX2 (an Arm Mac, or a compiler that
 * refuses -march=native) gives the AVX2 build's bits (tests/test_gguf_kernels.py builds both).
 * hsum8's order: lanes l and l + 4, then 0 + 2 and 1 + 3, then those two. */
static float hsum8(const float v[8]) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
#endif
#ifdef MI_NEON
/* hsum8 of the 8 lanes lo (0-3), hi (4-7). */
static inline float neon_hsum8(float32x4_t lo, float32x4_t hi) {
    float32x4_t t = vaddq_f32(lo, hi);
    return (vgetq_lane_f32(t, 0) + vgetq_lane_f32(t, 2)) + (vgetq_lane_f32(t, 1) + vgetq_lane_f32(t, 3));
}

/* decode32's 32 values (below) as two vectors of 16 (values 0-15 and 16-31), for the quantized types. */
typedef struct { int8x16_t lo, hi; } q32;

static inline __attribute__((always_inline)) q32 neon_values(int type, const uint8_t *w, int g) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    uint8x16_t lo, hi;
    switch (type) {
    case T_Q8_0:
        return (q32){vld1q_s8((const int8_t *)(w + 2)), vld1q_s8((const int8_t *)(w + 18))};
    case T_Q4_0: {
        uint8x16_t b = vld1q_u8(w + 2);
        return (q32){vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, m4)), vdupq_n_s8(8)),
                     vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), vdupq_n_s8(8))};
    }
    case T_Q5_0: { /* the fifth bit of value i is bit i of qh: a byte of qh per 8 values, tested per lane */
        const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128}, b5 = vdupq_n_u8(0x10);
        uint8x16_t b = vld1q_u8(w + 6);
        uint8x16_t h0 = vcombine_u8(vdup_n_u8(w[2]), vdup_n_u8(w[3])), h1 = vcombine_u8(vdup_n_u8(w[4]), vdup_n_u8(w[5]));
        lo = vorrq_u8(vandq_u8(b, m4), vandq_u8(vtstq_u8(h0, bit), b5));
        hi = vorrq_u8(vshrq_n_u8(b, 4), vandq_u8(vtstq_u8(h1, bit), b5));
        return (q32){vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(16)), vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(16))};
    }
    case T_Q4_1: {
        uint8x16_t b = vld1q_u8(w + 4);
        return (q32){vreinterpretq_s8_u8(vandq_u8(b, m4)), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
    }
    case T_Q4_K: {
        const uint8_t *qq = w + 16 + 32 * (g / 2);
        lo = vld1q_u8(qq), hi = vld1q_u8(qq + 16);
        if (g % 2) return (q32){vreinterpretq_s8_u8(vshrq_n_u8(lo, 4)), vreinterpretq_s8_u8(vshrq_n_u8(hi, 4))};
        return (q32){vreinterpretq_s8_u8(vandq_u8(lo, m4)), vreinterpretq_s8_u8(vandq_u8(hi, m4))};
    }
    default: { /* T_Q6_K */
        int half = g / 4, j = g % 4;
        const uint8_t *l = w + 64 * half + (j % 2) * 32, *h = w + 128 + 32 * half;
        const int8x16_t down = vdupq_n_s8((int8_t)(j < 2 ? 0 : -4)), hdown = vdupq_n_s8((int8_t)(-2 * j));
        const uint8x16_t m2 = vdupq_n_u8(3);
        lo = vorrq_u8(vandq_u8(vshlq_u8(vld1q_u8(l), down), m4), vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(h), hdown), m2), 4));
        hi = vorrq_u8(vandq_u8(vshlq_u8(vld1q_u8(l + 16), down), m4),
                      vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(h + 16), hdown), m2), 4));
        return (q32){vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(32)), vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(32))};
    }
    }
}

/* 32 values as float32, in eight vectors of 4 (vector v: values 4v .. 4v + 3). */
static inline __attribute__((always_inline)) void neon_to_f32(q32 q, float32x4_t w[8]) {
    int16x8_t h[4] = {vmovl_s8(vget_low_s8(q.lo)), vmovl_high_s8(q.lo), vmovl_s8(vget_low_s8(q.hi)), vmovl_high_s8(q.hi)};
    for (int j = 0; j < 4; j++) {
        w[2 * j] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h[j])));
        w[2 * j + 1] = vcvtq_f32_s32(vmovl_high_s16(h[j]));
    }
}
#endif

#ifdef MI_AVX2
/* 32 weights of one chunk, as four vectors of 8 (positions 0-7, 8-15, 16-23, 24-31). */
typedef struct { __m256 v[4]; } w32;

/* 32 signed bytes -> four float32 vectors of 8. */
static inline w32 i8_to_f32(__m256i q) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w32 w;
    w.v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w.v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w.v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w.v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    return w;
}

/* w = q * s (one scale), as gguf-py multiplies: exact float32 products. */
static inline w32 scale32(w32 w, __m256 s) {
    for (int j = 0; j < 4; j++) w.v[j] = _mm256_mul_ps(w.v[j], s);
    return w;
}

/* 16 bytes -> 32 bytes: the low nibbles, then the high nibbles (the 32-block order). */
static inline __m256i nibbles(const uint8_t *p) {
    /* both halves hold the 16 bytes; the upper half shifted right by 4 (bits from the next byte
     * land above bit 3 and are masked off) */
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte i <- bit i). */
static inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* Q6_K block w, half 0 or 1 (weights 128 * half ...): its 6-bit values 0-63 as four vectors of
 * 32 bytes, q[g] holding weights 128 * half + 32 * g ... + 31 (ggml's dequantize_row_q6_K). */
static inline void q6k_half(const uint8_t *w, int half, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4));
}

/* Q5_0 block w's 32 values, q5 - 16, as signed bytes. */
static inline __m256i q5_0_bytes(const uint8_t *w) {
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    /* q5 - 16 = q4 where the fifth bit is set, else q4 - 16 = q4 | 0xF0 (two's complement):
     * one andnot and one or (ggml's ggml_vec_dot_q5_0_q8_0 does the same) */
    return _mm256_or_si256(nibbles(w + 6), _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8((char)0xF0)));
}

/* Consume 32 weights against m input rows at column offset xo: four accumulators per row. */
#define CONSUME(W, XO)                                                                           \
    do {                                                                                         \
        const float *xp_ = x + (XO);                                                             \
        if (m == 1) {                                                                            \
            for (int j_ = 0; j_ < 4; j_++) a[j_] = _mm256_fmadd_ps((W).v[j_], _mm256_loadu_ps(xp_ + 8 * j_), a[j_]); \
        } else {                                                                                 \
            /* four accumulators per row, as for one row, so that a row's sum does not depend \
             * on the rows beside it */                                                          \
            for (int i_ = 0; i_ < m; i_++)                                                       \
                for (int j_ = 0; j_ < 4; j_++)                                                   \
                    a[4 * i_ + j_] = _mm256_fmadd_ps((W).v[j_], _mm256_loadu_ps(xp_ + i_ * k + 8 * j_), a[4 * i_ + j_]); \
        }                                                                                        \
    } while (0)

static void row_simd(int type, const uint8_t *w, int64_t nb, const float *x, int64_t k, int m, __m256 *a) {
    switch (type) {
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, w += 34) {
            PREFETCH_BLOCK(w, 34);
            w32 v = scale32(i8_to_f32(_mm256_loadu_si256((const __m256i *)(w + 2))), _mm256_set1_ps(rd_half(w)));
            CONSUME(v, b * 32);
        }
        return;
    case T_Q5_0:
        for (int64_t b = 0; b < nb; b++, w += 22) {
            w32 v = scale32(i8_to_f32(q5_0_bytes(w)), _mm256_set1_ps(rd_half(w)));
            CONSUME(v, b * 32);
        }
        return;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, w += 20) {
            PREFETCH_BLOCK(w, 20);
            w32 v = scale32(i8_to_f32(nibbles(w + 4)), _mm256_set1_ps(rd_half(w)));
            __m256 mn = _mm256_set1_ps(rd_half(w + 2));
            for (int j = 0; j < 4; j++) v.v[j] = _mm256_add_ps(v.v[j], mn);
            CONSUME(v, b * 32);
        }
        return;
    case T_Q4_K:
        for (int64_t b = 0; b < nb; b++, w += 144) {
            PREFETCH_BLOCK(w, 144);
            float d = rd_half(w), dmin = rd_half(w + 2);
            const uint8_t *s = w + 4;
            for (int j = 0; j < 4; j++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
                __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
                for (int h = 0; h < 2; h++) {
                    int g = 2 * j + h, sc, mn;
                    q4k_scale_min(s, g, &sc, &mn);
                    w32 v = scale32(i8_to_f32(h ? hi : lo), _mm256_set1_ps(d * (float)sc));
                    __m256 ml = _mm256_set1_ps(dmin * (float)mn);
                    for (int t = 0; t < 4; t++) v.v[t] = _mm256_sub_ps(v.v[t], ml);
                    CONSUME(v, b * 256 + 32 * g);
                }
            }
        }
        return;
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, w += 210) {
            PREFETCH_BLOCK(w, 210);
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = rd_half(w + 208);
            const __m256i c32 = _mm256_set1_epi8(32);
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6k_half(w, half, q);
                for (int g = 0; g < 4; g++) {
                    const int8_t *scg = sc + 8 * half + 2 * g;
                    __m256 s0 = _mm256_set1_ps(d * (float)scg[0]), s1 = _mm256_set1_ps(d * (float)scg[1]);
                    w32 v = i8_to_f32(_mm256_sub_epi8(q[g], c32));
                    v.v[0] = _mm256_mul_ps(v.v[0], s0);
                    v.v[1] = _mm256_mul_ps(v.v[1], s0);
                    v.v[2] = _mm256_mul_ps(v.v[2], s1);
                    v.v[3] = _mm256_mul_ps(v.v[3], s1);
                    CONSUME(v, b * 256 + 128 * half + 32 * g);
                }
            }
        }
        return;
    default: { /* F32, F16, Q4_0: the block dequantizer into a buffer */
        int qk = 32, bytes = 128;
        deq_fn fn = deq_f32;
        type_info(type, &qk, &bytes, &fn);
        float wbuf[256] __attribute__((aligned(32)));
        for (int64_t b = 0; b < nb; b++) {
            fn(w + b * bytes, wbuf);
            for (int c = 0; c < qk; c += 32) {
                w32 v;
                for (int j = 0; j < 4; j++) v.v[j] = _mm256_load_ps(wbuf + c + 8 * j);
                CONSUME(v, b * qk + c);
            }
        }
    }
    }
}
#endif

#ifndef MI_AVX2
/* Weight row w's values of 32-block g of block b (its xi-th 32 columns), as the AVX2 kernels
 * decode them: signed q5 - 16, nibble - 8, int8, unsigned nibbles (Q4_1, Q4_K, with their
 * minimum kept apart) or Q6_K's q6 - 32 with the two 16-weight scales in s2. Returns the
 * float32 scale of the block's integer dot product (d, or Q4_K's d * sc) and sets *minus to
 * the minimum's factor (Q4_1: m; Q4_K: -(dmin * mn), so minus + mfac * s is row_q8's
 * minus - ml * s exactly; 0 for the types without a minimum). With q NULL, only the scales. */
static inline __attribute__((always_inline)) float decode32(int type, const uint8_t *w, int g, int8_t q[32], int s2[2],
                                                            float *minus) {
    *minus = 0;
    s2[0] = s2[1] = 1;
    switch (type) {
    case T_Q8_0:
        if (q) memcpy(q, w + 2, 32);
        return rd_half(w);
    case T_Q4_0:
        for (int i = 0; q && i < 16; i++) q[i] = (int8_t)((w[2 + i] & 0xF) - 8), q[i + 16] = (int8_t)((w[2 + i] >> 4) - 8);
        return rd_half(w);
    case T_Q5_0: {
        uint32_t qh = (uint32_t)w[2] | ((uint32_t)w[3] << 8) | ((uint32_t)w[4] << 16) | ((uint32_t)w[5] << 24);
        for (int i = 0; q && i < 16; i++) {
            q[i] = (int8_t)(((w[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) - 16);
            q[i + 16] = (int8_t)(((w[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
        return rd_half(w);
    }
    case T_Q4_1:
        for (int i = 0; q && i < 16; i++) q[i] = (int8_t)(w[4 + i] & 0xF), q[i + 16] = (int8_t)(w[4 + i] >> 4);
        *minus = rd_half(w + 2);
        return rd_half(w);
    case T_Q4_K: {
        int sc, mn;
        q4k_scale_min(w + 4, g, &sc, &mn);
        const uint8_t *qq = w + 16 + 32 * (g / 2);
        for (int i = 0; q && i < 32; i++) q[i] = (int8_t)(g % 2 ? qq[i] >> 4 : qq[i] & 0xF);
        *minus = -(rd_half(w + 2) * (float)mn);
        return rd_half(w) * (float)sc;
    }
    case T_Q6_K: {
        int half = g / 4, j = g % 4;
        const uint8_t *l = w + 64 * half + (j % 2) * 32, *h = w + 128 + 32 * half;
        for (int i = 0; q && i < 32; i++)
            q[i] = (int8_t)((((j < 2 ? l[i] : l[i] >> 4) & 0xF) | (((h[i] >> (2 * j)) & 3) << 4)) - 32);
        const int8_t *sc = (const int8_t *)(w + 192) + 8 * half + 2 * j;
        s2[0] = sc[0], s2[1] = sc[1];
        return rd_half(w + 208);
    }
    }
    return 0;
}
#endif

/* One weight row against m input rows: acc[i] = sum_k w[k] * x[i][k]. */
static void row_dots(int type, const uint8_t *wrow, int64_t nb, int qk, int bytes, deq_fn fn,
                     const float *x, int64_t k, int m, float *acc) {
#ifdef MI_AVX2
    (void)qk, (void)bytes, (void)fn;
    __m256 a[4 * MAX_ROWS];
    for (int i = 0; i < 4 * m; i++) a[i] = _mm256_setzero_ps();
    row_simd(type, wrow, nb, x, k, m, a);
    for (int i = 0; i < m; i++)
        acc[i] = hsum8(_mm256_add_ps(_mm256_add_ps(a[4 * i], a[4 * i + 1]), _mm256_add_ps(a[4 * i + 2], a[4 * i + 3])));
#else
    /* row_simd's four 8-lane accumulators per row, as 32 floats: weight j of every 32 goes to
     * accumulator j / 8, lane j % 8; the dequantized weights are row_simd's (both equal gguf-py's) */
    (void)type;
    float wbuf[256];
#ifdef MI_NEON
    float32x4_t va[MAX_ROWS][8]; /* vector v: positions 4v .. 4v + 3 of every 32 */
    for (int i = 0; i < m; i++)
        for (int v = 0; v < 8; v++) va[i][v] = vdupq_n_f32(0);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wrow + b * bytes;
        const float *xb = x + b * qk;
        int quant = type != T_F32 && type != T_F16;
        if (!quant) fn(w, wbuf);
        for (int c = 0; c < qk; c += 32) {
            float32x4_t wv[8];
            if (quant) { /* the block dequantizer's float32 operations, four weights at a time */
                int s2[2];
                float mfac, d = decode32(type, w, c / 32, NULL, s2, &mfac);
                neon_to_f32(neon_values(type, w, c / 32), wv);
                for (int v = 0; v < 8; v++) {
                    wv[v] = vmulq_n_f32(wv[v], type == T_Q6_K ? d * (float)s2[v / 4] : d);
                    if (type == T_Q4_1 || type == T_Q4_K) wv[v] = vaddq_f32(wv[v], vdupq_n_f32(mfac)); /* + m, - ml */
                }
            } else {
                for (int v = 0; v < 8; v++) wv[v] = vld1q_f32(wbuf + c + 4 * v);
            }
            for (int i = 0; i < m; i++)
                for (int v = 0; v < 8; v++) va[i][v] = vfmaq_f32(va[i][v], wv[v], vld1q_f32(xb + i * k + c + 4 * v));
        }
    }
    for (int i = 0; i < m; i++) /* positions l, 8 + l, 16 + l, 24 + l summed as below */
        acc[i] = neon_hsum8(vaddq_f32(vaddq_f32(va[i][0], va[i][2]), vaddq_f32(va[i][4], va[i][6])),
                            vaddq_f32(vaddq_f32(va[i][1], va[i][3]), vaddq_f32(va[i][5], va[i][7])));
    return;
#endif
    float a[MAX_ROWS][32];
    memset(a, 0, sizeof(a));
    for (int64_t b = 0; b < nb; b++) {
        fn(wrow + b * bytes, wbuf);
        const float *xb = x + b * qk;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < qk; j++) a[i][j & 31] = fmaf(wbuf[j], xb[i * k + j], a[i][j & 31]);
    }
    for (int i = 0; i < m; i++) {
        float s[8];
        for (int l = 0; l < 8; l++) s[l] = (a[i][l] + a[i][8 + l]) + (a[i][16 + l] + a[i][24 + l]);
        acc[i] = hsum8(s);
    }
#endif
}

/* ------------------------------------------------------------------ int8 activations
 * The fast mode ("gguf-a8"): each input row is quantized per 32 columns to int8 as ggml's
 * quantize_row_q8_0 does (scale dx = max|x| / 127, q = round(x / dx)), with the block's sum
 * sx = dx * sum(q) kept for the types with a minimum (Q4_1, Q4_K). A block's product is then an
 * integer dot product (maddubs / madd), scaled once: llama.cpp's CPU path (ggml_vec_dot_*_q8_*). */

#ifdef MI_AVX2
/* One 32-block xb rounded, 8 lanes at a time: q[0..3] = x * id clamped to [-lim, lim] and
 * rounded to integral floats (NaN inputs -> 0), and the block's scale d = max|x| / lim (NaN when
 * the block holds a NaN). max|x| ignores NaN, as fmaxf does (_mm256_max_ps returns its second
 * operand when one is NaN); halves round away from zero, as roundf. The one rounding of every
 * integer path: quantize_blocks and mi_round_activations.
 * The clamp matters: C leaves the float -> int conversion undefined for NaN and for values
 * outside int, and x * id is +-inf or NaN (0 * inf) when a block's largest |x| is so small that
 * its scale is subnormal and 1 / scale overflows (hidden states with subnormal values pass the
 * hop's checks). NaN rounds to 0 and the block's scale is NaN, so NaN in gives NaN out, as
 * with float32 activations (the step is then refused). */
static inline float round_block(const float *xb, int lim, __m256 q[4]) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    for (int j = 0; j < 32; j += 8) {
        __m256 v = _mm256_loadu_ps(xb + j);
        vmax = _mm256_max_ps(_mm256_and_ps(v, absmask), vmax);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], amax = 0;
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) amax = fmaxf(amax, lanes[j]);
    float d = amax / (float)lim, id = d ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps((float)lim), lo = _mm256_set1_ps(-(float)lim),
                 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (int j = 0; j < 4; j++) {
        __m256 f = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vid);
        __m256 bad = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
        __m256 c = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
        __m256 t = _mm256_round_ps(c, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(c, t), absmask), half, _CMP_GE_OQ);
        __m256 step = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_andnot_ps(absmask, c))); /* +-1 or +0 */
        q[j] = _mm256_andnot_ps(bad, _mm256_add_ps(t, step)); /* -0 + +0 = +0, as (int) gives */
    }
    return _mm256_movemask_ps(vnan) ? NAN : d;
}

/* Each 32-block of x (m, k) rounded (round_block) into integers: q (m, k) int8 (lim 127) or
 * int16 (lim 32767), scales d and d * sum(q) in s (m, k / 32; NaN for a block with a NaN). */
static void quantize_blocks(const float *x, int64_t m, int64_t k, int lim, void *q, float *d, float *s) {
    int64_t nb = k / 32;
    for (int64_t i = 0; i < m * nb; i++) {
        __m256 v[4];
        int32_t ints[32];
        float di = round_block(x + i * 32, lim, v);
        __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])); /* exact: < 2^24 */
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(ints + 8 * j), _mm256_cvtps_epi32(v[j]));
        if (lim == 127)
            for (int j = 0; j < 32; j++) ((int8_t *)q)[i * 32 + j] = (int8_t)ints[j];
        else
            for (int j = 0; j < 32; j++) ((int16_t *)q)[i * 32 + j] = (int16_t)ints[j];
        d[i] = di;
        s[i] = di * hsum8(sum);
    }
}

#else
/* round_block without AVX2: the same values (the largest |x| ignoring NaN, the scale, x * id
 * clamped and rounded half away from zero, NaN -> 0), as 32 integers. */
static float round_block(const float *xb, int lim, int32_t q[32]) {
    float amax = 0;
    int nan = 0;
    for (int j = 0; j < 32; j++) {
        float a = fabsf(xb[j]);
        nan |= a != a;
        if (a > amax) amax = a;
    }
    float d = amax / (float)lim, id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        float f = xb[j] * id;
        q[j] = f != f ? 0 : (int32_t)roundf(fminf(fmaxf(f, -(float)lim), (float)lim));
    }
    return nan ? NAN : d;
}

static void quantize_blocks(const float *x, int64_t m, int64_t k, int lim, void *q, float *d, float *s) {
    int64_t nb = k / 32;
    for (int64_t i = 0; i < m * nb; i++) {
        int32_t ints[32], sum = 0;
        float di = round_block(x + i * 32, lim, ints);
        for (int j = 0; j < 32; j++) {
            sum += ints[j];
            if (lim == 127)
                ((int8_t *)q)[i * 32 + j] = (int8_t)ints[j];
            else
                ((int16_t *)q)[i * 32 + j] = (int16_t)ints[j];
        }
        d[i] = di;
        s[i] = di * (float)sum; /* exact, as the AVX2 sum of integral floats (|sum| < 2^24) */
    }
}

#ifdef MI_NEON
/* The 8 int32 lane sums of values q against int8 x (lanes 0-3, 4-7): lane l sums columns
 * 4l .. 4l + 3 (sdot where the CPU has it; else products, then pair sums twice). */
static inline __attribute__((always_inline)) void neon_lanes8(q32 q, const int8_t *x, int32x4_t out[2]) {
    int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
#ifdef __ARM_FEATURE_DOTPROD
    out[0] = vdotq_s32(vdupq_n_s32(0), q.lo, x0);
    out[1] = vdotq_s32(vdupq_n_s32(0), q.hi, x1);
#else
    out[0] = vpaddq_s32(vpaddlq_s16(vmull_s8(vget_low_s8(q.lo), vget_low_s8(x0))), vpaddlq_s16(vmull_high_s8(q.lo, x0)));
    out[1] = vpaddq_s32(vpaddlq_s16(vmull_s8(vget_low_s8(q.hi), vget_low_s8(x1))), vpaddlq_s16(vmull_high_s8(q.hi, x1)));
#endif
}

/* Pair sums q[2j] x[2j] + q[2j+1] x[2j+1] of 8 int16 values against int16 x, j = 0..3. */
static inline __attribute__((always_inline)) int32x4_t neon_pairs16(int16x8_t q, const int16_t *x) {
    int16x8_t xv = vld1q_s16(x);
    return vpaddq_s32(vmull_s16(vget_low_s16(q), vget_low_s16(xv)), vmull_high_s16(q, xv));
}

/* The 8 int32 lane sums of values q against int16 x: lane l = s0 (pair l) + s1 (pair 8 + l). */
static inline __attribute__((always_inline)) void neon_lanes16(q32 q, const int16_t *x, int s0, int s1, int32x4_t out[2]) {
    int32x4_t p0 = neon_pairs16(vmovl_s8(vget_low_s8(q.lo)), x), p1 = neon_pairs16(vmovl_high_s8(q.lo), x + 8);
    int32x4_t p2 = neon_pairs16(vmovl_s8(vget_low_s8(q.hi)), x + 16), p3 = neon_pairs16(vmovl_high_s8(q.hi), x + 24);
    out[0] = vmlaq_n_s32(vmulq_n_s32(p0, s0), p2, s1);
    out[1] = vmlaq_n_s32(vmulq_n_s32(p1, s0), p3, s1);
}
#endif

#ifdef MI_NEON
/* lanes of 32 values against int8 (act_bits 8) or int16 (16) activations x, as lanes_c. */
static inline __attribute__((always_inline)) void lanes_neon(int act_bits, int type, q32 q, const void *x,
                                                             const int s2[2], int32x4_t out[2]) {
    if (act_bits == 16) {
        neon_lanes16(q, (const int16_t *)x, s2[0], s2[1], out);
        return;
    }
    neon_lanes8(q, (const int8_t *)x, out);
    if (type == T_Q6_K) out[0] = vmulq_n_s32(out[0], s2[0]), out[1] = vmulq_n_s32(out[1], s2[1]);
}
#else
/* The 8 int32 lane sums of 32 values q against int8 (act_bits 8) or int16 (16) activations x,
 * as row_q8 / row_q16 form them: int8, lane l sums columns 4l .. 4l + 3 (maddubs, then madd),
 * times Q6_K's scale of its half (s2[l / 4]); int16, s2[0] times the pair 2l, 2l + 1 plus
 * s2[1] times the pair 16 + 2l, 17 + 2l (madd over each half). Written as products, then pair
 * sums: shapes a compiler vectorizes. */
static inline __attribute__((always_inline)) void lanes_c(int act_bits, const int8_t q[32], const void *x,
                                                          const int s2[2], int32_t lanes[8]) {
    int32_t pairs[16];
    if (act_bits == 8) {
        const int8_t *xr = (const int8_t *)x;
        int16_t p[32]; /* |q x| <= 128 * 127 */
        for (int j = 0; j < 32; j++) p[j] = (int16_t)(q[j] * xr[j]);
        for (int j = 0; j < 16; j++) pairs[j] = p[2 * j] + p[2 * j + 1];
        for (int l = 0; l < 8; l++) lanes[l] = (pairs[2 * l] + pairs[2 * l + 1]) * s2[l / 4];
    } else {
        const int16_t *xr = (const int16_t *)x;
        for (int j = 0; j < 16; j++) pairs[j] = q[2 * j] * xr[2 * j] + q[2 * j + 1] * xr[2 * j + 1];
        for (int l = 0; l < 8; l++) lanes[l] = s2[0] * pairs[l] + s2[1] * pairs[8 + l];
    }
}
#endif

/* One weight row (nb blocks of qk weights, bytes each) against m int8 (act_bits 8) or int16
 * (16) input rows xq, as row_q8 / row_q16: per 32-block, eight int32 lane sums (lanes_c,
 * lanes_neon), each converted to float32 and fused-multiply-added with the block's scale times
 * the row's (xd); the minimum terms (Q4_1, Q4_K: mfac times the row's block sum xs) summed
 * apart. All integer sums are exact, so their order does not matter. */
static inline __attribute__((always_inline)) void row_int_t(int act_bits, int type, const uint8_t *w, int64_t nb,
                                                            int qk, int bytes, int64_t k, int m, const void *xq,
                                                            const float *xd, const float *xs, int64_t xb, float *out) {
    float minus[MAX_ROWS];
    memset(minus, 0, sizeof(minus));
#ifdef MI_NEON
    float32x4_t acc[MAX_ROWS][2]; /* lanes 0-3, 4-7 */
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = vdupq_n_f32(0);
#else
    float acc[MAX_ROWS][8];
    memset(acc, 0, sizeof(acc));
#endif
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        PREFETCH_BLOCK(w, bytes);
        for (int g = 0; g < qk / 32; g++) {
            int s2[2];
            float mfac;
#ifdef MI_NEON
            float d = decode32(type, w, g, NULL, s2, &mfac);
            q32 q = neon_values(type, w, g);
#else
            int8_t q[32];
            float d = decode32(type, w, g, q, s2, &mfac);
#endif
            int64_t xi = b * (qk / 32) + g;
            for (int i = 0; i < m; i++) {
                const void *xr = (const char *)xq + (i * k + 32 * xi) * (act_bits / 8);
                float f = d * xd[i * xb + xi];
#ifdef MI_NEON
                int32x4_t lanes[2];
                lanes_neon(act_bits, type, q, xr, s2, lanes);
                acc[i][0] = vfmaq_f32(acc[i][0], vcvtq_f32_s32(lanes[0]), vdupq_n_f32(f));
                acc[i][1] = vfmaq_f32(acc[i][1], vcvtq_f32_s32(lanes[1]), vdupq_n_f32(f));
#else
                int32_t lanes[8];
                lanes_c(act_bits, q, xr, s2, lanes);
                for (int l = 0; l < 8; l++) acc[i][l] = fmaf((float)lanes[l], f, acc[i][l]);
#endif
                if (type == T_Q4_1 || type == T_Q4_K) minus[i] += mfac * xs[i * xb + xi]; /* NaN and inf as AVX2 */
            }
        }
    }
    for (int i = 0; i < m; i++) {
#ifdef MI_NEON
        out[i] = neon_hsum8(acc[i][0], acc[i][1]) + minus[i];
#else
        out[i] = hsum8(acc[i]) + minus[i];
#endif
    }
}

/* row_int_t with act_bits, type and (for a decode step) m constants: one loop per case. */
static void row_int(int act_bits, int type, const uint8_t *w, int64_t nb, int qk, int bytes, int64_t k, int m,
                    const void *xq, const float *xd, const float *xs, int64_t xb, float *out) {
#define ROW_INT(T)                                                                                     \
    case T:                                                                                            \
        if (act_bits == 8 && m == 1)                                                                   \
            row_int_t(8, T, w, nb, qk, bytes, k, 1, xq, xd, xs, xb, out);                              \
        else if (act_bits == 8)                                                                        \
            row_int_t(8, T, w, nb, qk, bytes, k, m, xq, xd, xs, xb, out);                              \
        else if (m == 1)                                                                               \
            row_int_t(16, T, w, nb, qk, bytes, k, 1, xq, xd, xs, xb, out);                             \
        else                                                                                           \
            row_int_t(16, T, w, nb, qk, bytes, k, m, xq, xd, xs, xb, out);                             \
        break;
    switch (type) {
        ROW_INT(T_Q8_0) ROW_INT(T_Q4_0) ROW_INT(T_Q5_0) ROW_INT(T_Q4_1) ROW_INT(T_Q4_K) ROW_INT(T_Q6_K)
    }
#undef ROW_INT
}
#endif

#ifdef MI_AVX2
/* Unsigned a (<= 128) x signed b (|b| <= 127) -> 8 int32 lanes: lane l sums the products of
 * bytes 4l .. 4l + 3 (maddubs's pair sums, at most 2 * 128 * 127, fit int16 unsaturated). */
static inline __m256i dot_u8(__m256i a, __m256i b) {
#ifdef MI_VNNI
    return mi_dpbusd(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* One weight row against m quantized input rows (the block is decoded once for all rows):
 * out[i] = the dot product with row i. Row i's result does not depend on m. */
#define FOR_ROWS(BODY) for (int i = 0; i < m; i++) { const int8_t *xr = xq + i * k; (void)xr; BODY; }
static inline __attribute__((always_inline)) void row_q8(int type, const uint8_t *w, int64_t nb, int64_t k, int m, const int8_t *xq,
                   const float *xd, const float *xs, int64_t xb, float *out) {
    __m256 acc[MAX_ROWS];
    float minus[MAX_ROWS]; /* the min terms of Q4_1 (+m sum x) and Q4_K (-dmin m sum x) */
    for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps(), minus[i] = 0;
    switch (type) {
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, w += 34) {
            PREFETCH_BLOCK(w, 34);
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2)), qa = _mm256_sign_epi8(q, q);
            float d = rd_half(w);
            FOR_ROWS(__m256i p = dot_u8(qa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + 32 * b)), q));
                     acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                              _mm256_set1_ps(d * xd[i * xb + b]), acc[i]))
        }
        break;
    case T_Q5_0:
    case T_Q4_0:
        for (int64_t b = 0; b < nb; b++, w += (type == T_Q5_0 ? 22 : 18)) {
            PREFETCH_BLOCK(w, (type == T_Q5_0 ? 22 : 18));
            __m256i q;
            if (type == T_Q5_0) {
                q = q5_0_bytes(w);
            } else {
                q = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
            }
            __m256i qa = _mm256_sign_epi8(q, q);
            float d = rd_half(w);
            FOR_ROWS(__m256i p = dot_u8(qa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + 32 * b)), q));
                     acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                              _mm256_set1_ps(d * xd[i * xb + b]), acc[i]))
        }
        break;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, w += 20) {
            PREFETCH_BLOCK(w, 20);
            __m256i q = nibbles(w + 4);
            float d = rd_half(w), mn = rd_half(w + 2);
            FOR_ROWS(__m256i dd = dot_u8(q, _mm256_loadu_si256((const __m256i *)(xr + 32 * b)));
                     acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dd), _mm256_set1_ps(d * xd[i * xb + b]), acc[i]);
                     minus[i] += mn * xs[i * xb + b]) /* w = d q + m */
        }
        break;
    case T_Q4_K:
        for (int64_t b = 0; b < nb; b++, w += 144) {
            PREFETCH_BLOCK(w, 144);
            float d = rd_half(w), dmin = rd_half(w + 2);
            const uint8_t *s = w + 4;
            for (int j = 0; j < 4; j++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
                __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
                for (int h = 0; h < 2; h++) {
                    int g = 2 * j + h, sc, mn;
                    q4k_scale_min(s, g, &sc, &mn);
                    __m256i q = h ? hi : lo;
                    float dl = d * (float)sc, ml = dmin * (float)mn;
                    int64_t xi = 8 * b + g;
                    FOR_ROWS(__m256i dd = dot_u8(q, _mm256_loadu_si256((const __m256i *)(xr + 32 * xi)));
                             acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dd), _mm256_set1_ps(dl * xd[i * xb + xi]), acc[i]);
                             minus[i] -= ml * xs[i * xb + xi])
                }
            }
        }
        break;
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, w += 210) {
            PREFETCH_BLOCK(w, 210);
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = rd_half(w + 208);
            const __m256i c32 = _mm256_set1_epi8(32);
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6k_half(w, half, q);
                for (int g = 0; g < 4; g++) {
                    int64_t xi = 8 * b + 4 * half + g; /* the 32-block of x */
                    const int8_t *scg = sc + 8 * half + 2 * g;
                    __m256i qs = _mm256_sub_epi8(q[g], c32), qa = _mm256_sign_epi8(qs, qs);
                    /* 16-bit pairs 0-7 are values 0-15 (scale scg[0]), 8-15 values 16-31 (scg[1]) */
                    __m256i scales = _mm256_setr_epi16(scg[0], scg[0], scg[0], scg[0], scg[0], scg[0], scg[0], scg[0],
                                                       scg[1], scg[1], scg[1], scg[1], scg[1], scg[1], scg[1], scg[1]);
                    FOR_ROWS(__m256i p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + 32 * xi)), qs));
                             acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, scales)),
                                                      _mm256_set1_ps(d * xd[i * xb + xi]), acc[i]))
                }
            }
        }
        break;
    }
    for (int i = 0; i < m; i++) out[i] = hsum8(acc[i]) + minus[i];
}
#endif

/* Whether the integer-activation kernels (int8 and int16) take `type`: 1 or 0. */
int mi_supports_q8(int type) {
    return type == T_Q8_0 || type == T_Q5_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K || type == T_Q6_K;
}

/* ------------------------------------------------------------------ int16 activations
 * The near-exact mode ("gguf-a16"): each input row is quantized per 32 columns to int16
 * (scale dx = max|x| / 32767, round to nearest; error at most dx / 2, about 1.5e-5 of the
 * block's largest value, where bfloat16 keeps 8 bits), and each block's product is an integer
 * dot product of int16 pairs (madd), scaled once. The weights are the file's, exactly. */


#ifdef MI_AVX2
/* Weights lo (values 0-15) and hi (16-31) as int16 against 32 int16 activations x -> 8 int32
 * lanes: lane l sums the products of values 2l, 2l + 1 and of 16 + 2l, 17 + 2l. */
static inline __m256i dot16_pairs(__m256i lo, __m256i hi, const int16_t *x) {
    __m256i first = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
#ifdef MI_VNNI
    return mi_dpwssd(first, hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
#else
    return _mm256_add_epi32(first, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
#endif
}

/* 32 int8 weights (|w| <= 128) times 32 int16 activations -> 8 int32 partial sums. */
static inline __m256i dot16(__m256i q, const int16_t *x) {
    __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    return dot16_pairs(lo, hi, x);
}

/* The same with weights 0-15 scaled by s0 and 16-31 by s1 first (Q6_K's 16-weight scales;
 * |q * s| <= 32 * 128 fits int16, each pair sum fits int32). */
static inline __m256i dot16_scaled(__m256i q, int s0, int s1, const int16_t *x) {
    __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16((short)s0));
    __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16((short)s1));
    return dot16_pairs(lo, hi, x);
}

/* One weight row against m int16 input rows (see row_q8). */
static inline __attribute__((always_inline)) void row_q16(int type, const uint8_t *w, int64_t nb, int64_t k, int m,
                                                          const int16_t *xq, const float *xd, const float *xs,
                                                          int64_t xb, float *out) {
    __m256 acc[MAX_ROWS];
    float minus[MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps(), minus[i] = 0;
#define ROWS16(BODY) for (int i = 0; i < m; i++) { const int16_t *xr = xq + i * k; BODY; }
    switch (type) {
    case T_Q8_0:
    case T_Q5_0:
    case T_Q4_0: {
        int bytes = type == T_Q8_0 ? 34 : (type == T_Q5_0 ? 22 : 18);
        for (int64_t b = 0; b < nb; b++, w += bytes) {
            PREFETCH_BLOCK(w, bytes);
            __m256i q;
            if (type == T_Q8_0) {
                q = _mm256_loadu_si256((const __m256i *)(w + 2));
            } else if (type == T_Q5_0) {
                q = q5_0_bytes(w);
            } else {
                q = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
            }
            float d = rd_half(w);
            ROWS16(acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(q, xr + 32 * b)), _mm256_set1_ps(d * xd[i * xb + b]), acc[i]))
        }
        break;
    }
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, w += 20) {
            PREFETCH_BLOCK(w, 20);
            __m256i q = nibbles(w + 4);
            float d = rd_half(w), mn = rd_half(w + 2);
            ROWS16(acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(q, xr + 32 * b)), _mm256_set1_ps(d * xd[i * xb + b]), acc[i]);
                   minus[i] += mn * xs[i * xb + b])
        }
        break;
    case T_Q4_K:
        for (int64_t b = 0; b < nb; b++, w += 144) {
            PREFETCH_BLOCK(w, 144);
            float d = rd_half(w), dmin = rd_half(w + 2);
            const uint8_t *s = w + 4;
            for (int j = 0; j < 4; j++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
                __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
                for (int h = 0; h < 2; h++) {
                    int g = 2 * j + h, sc, mn;
                    q4k_scale_min(s, g, &sc, &mn);
                    __m256i q = h ? hi : lo;
                    float dl = d * (float)sc, ml = dmin * (float)mn;
                    int64_t xi = 8 * b + g;
                    ROWS16(acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(q, xr + 32 * xi)), _mm256_set1_ps(dl * xd[i * xb + xi]), acc[i]);
                           minus[i] -= ml * xs[i * xb + xi])
                }
            }
        }
        break;
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, w += 210) {
            PREFETCH_BLOCK(w, 210);
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = rd_half(w + 208);
            const __m256i c32 = _mm256_set1_epi8(32);
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6k_half(w, half, q);
                for (int g = 0; g < 4; g++) {
                    int64_t xi = 8 * b + 4 * half + g;
                    const int8_t *scg = sc + 8 * half + 2 * g;
                    __m256i qs = _mm256_sub_epi8(q[g], c32);
                    ROWS16(acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16_scaled(qs, scg[0], scg[1], xr + 32 * xi)),
                                                    _mm256_set1_ps(d * xd[i * xb + xi]), acc[i]))
                }
            }
        }
        break;
    }
#undef ROWS16
    for (int i = 0; i < m; i++) out[i] = hsum8(acc[i]) + minus[i];
}
#endif

#ifdef MI_AVX2
/* One row w (nb blocks) of a 32-weight-block type (Q8_0, Q5_0, Q4_0) against one input row
 * rounded to int8 (act_bits 8) or int16 (16) blocks xq with scales xd: the dot product. The same
 * operations in the same order as row_q8 / row_q16 with m = 1, so the same bits; each block's
 * product of scales d * dx is formed in the loop, as a vector (F16C's conversion of the half; a
 * scalar product without F16C). A decode step spends most of its time in this loop over Q5_0
 * blocks.
 * Until 2026-12-04 the products of scales were formed up to 64 blocks at a time before the
 * blocks' loop; forming them in the loop measured no slower, with less code (docs/performance.md,
 * "Long streams"). */
static inline __attribute__((always_inline)) float row1_q32(int act_bits, int type, const uint8_t *w, int64_t nb,
                                                           const void *xq, const float *xd) {
    const int bytes = type == T_Q8_0 ? 34 : (type == T_Q5_0 ? 22 : 18);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        PREFETCH_BLOCK(w, bytes);
        __m256i q, dot;
        if (type == T_Q8_0)
            q = _mm256_loadu_si256((const __m256i *)(w + 2));
        else if (type == T_Q5_0)
            q = q5_0_bytes(w);
        else
            q = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
        if (act_bits == 8) {
            __m256i x = _mm256_loadu_si256((const __m256i *)((const int8_t *)xq + 32 * b));
            dot = dot_u8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
        } else {
            dot = dot16(q, (const int16_t *)xq + 32 * b);
        }
#ifdef __F16C__ /* every AVX2 CPU has it; a compiler told otherwise takes the scalar product */
        uint16_t h;
        memcpy(&h, w, 2);
        const __m256 sd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)h)), _mm256_broadcast_ss(xd + b));
#else
        const __m256 sd = _mm256_set1_ps(rd_half(w) * xd[b]);
#endif
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, acc);
    }
    float minus = 0; /* as row_q8 adds its (zero) minimum term: a -0 sum comes out +0 */
    return hsum8(acc) + minus;
}

/* One row w (nb blocks) of Q4_K or Q6_K against one input row rounded to int8 (act_bits 8) or
 * int16 (16) blocks xq with scales xd and sums xs: the dot product. The same operations in the
 * same order as row_q8 / row_q16 with m = 1 (the same bits), except that each block's eight
 * products of scales (d * sc * dx, and Q4_K's dmin * mn * sx) are formed as one vector, and
 * Q6_K's int8 scale pairs are spread by one byte shuffle instead of a 16-lane set. */
static inline __attribute__((always_inline)) float row1_kquant(int act_bits, int type, const uint8_t *w, int64_t nb,
                                                              const void *xq, const float *xd, const float *xs) {
    const int bytes = type == T_Q4_K ? 144 : 210;
    __m256 acc = _mm256_setzero_ps();
    float minus = 0, dx[8], mx[8];
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        PREFETCH_BLOCK(w, bytes);
        const int8_t *x8 = (const int8_t *)xq + 256 * b;
        const int16_t *x16 = (const int16_t *)xq + 256 * b;
        if (type == T_Q4_K) {
            int sc[8], mn[8];
            for (int g = 0; g < 8; g++) q4k_scale_min(w + 4, g, &sc[g], &mn[g]);
            __m256 dl = _mm256_mul_ps(_mm256_set1_ps(rd_half(w)), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sc)));
            __m256 ml = _mm256_mul_ps(_mm256_set1_ps(rd_half(w + 2)), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)mn)));
            _mm256_storeu_ps(dx, _mm256_mul_ps(dl, _mm256_loadu_ps(xd + 8 * b)));
            _mm256_storeu_ps(mx, _mm256_mul_ps(ml, _mm256_loadu_ps(xs + 8 * b)));
            for (int j = 0; j < 4; j++) {
                __m256i qb = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
                for (int h = 0; h < 2; h++) {
                    int g = 2 * j + h;
                    __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(qb, 4) : qb, _mm256_set1_epi8(0x0F));
                    __m256i dot = act_bits == 8 ? dot_u8(q, _mm256_loadu_si256((const __m256i *)(x8 + 32 * g)))
                                                : dot16(q, x16 + 32 * g);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(dx + g), acc);
                }
            }
            for (int g = 0; g < 8; g++) minus -= mx[g];
        } else {
            const int8_t *sc = (const int8_t *)(w + 192);
            const __m128i sc16 = _mm_loadu_si128((const __m128i *)sc);
            _mm256_storeu_ps(dx, _mm256_mul_ps(_mm256_set1_ps(rd_half(w + 208)), _mm256_loadu_ps(xd + 8 * b)));
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6k_half(w, half, q);
                for (int g = 0; g < 4; g++) {
                    int G = 4 * half + g; /* the block's 32-weight group: scales sc[2G], sc[2G + 1] */
                    __m256i qs = _mm256_sub_epi8(q[g], _mm256_set1_epi8(32)), dot;
                    if (act_bits == 8) {
                        /* 16-bit pairs 0-7 are values 0-15 (scale sc[2G]), 8-15 values 16-31 (sc[2G + 1]) */
                        __m128i pick = _mm_or_si128(_mm_set1_epi8((char)(2 * G)),
                                                    _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
                        __m256i scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc16, pick));
                        __m256i x = _mm256_loadu_si256((const __m256i *)(x8 + 32 * G));
                        dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(qs, qs), _mm256_sign_epi8(x, qs)), scales);
                    } else {
                        dot = dot16_scaled(qs, sc[2 * G], sc[2 * G + 1], x16 + 32 * G);
                    }
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(dx + G), acc);
                }
            }
        }
    }
    return hsum8(acc) + minus;
}

/* Rows [r0, r1) of one weight (row_bytes apart, nb blocks each) against one input row rounded
 * to int8 (act_bits 8) or int16 (16) blocks xq with scales xd and sums xs: y[r] = the dot
 * product (+ bias[r]). Each case gives its row function (row1_q32 for the 32-weight block types,
 * row1_kquant for Q4_K and Q6_K, row_q8 / row_q16 for Q4_1) a constant type and one row, so the
 * compiler builds one tight loop per type: the per-row work outside the blocks is a few
 * instructions (a 896-wide row is only 28 blocks). The same bits as row_q8 / row_q16 with m = 1
 * (tests/test_gguf_kernels.py compares one row with the rows of a verification step). */
#define ROWS_ONE(FN, T, XT)                                                                           \
    for (int64_t r = r0; r < r1; r++) {                                                               \
        float o;                                                                                      \
        FN(T, w + r * row_bytes, nb, k, 1, (const XT *)xq, xd, xs, k / 32, &o);                        \
        y[r] = bias ? o + bias[r] : o;                                                                \
    }
#define ROWS32(T, XT)                                                                                 \
    for (int64_t r = r0; r < r1; r++) {                                                               \
        float o = row1_q32(sizeof(XT) * 8, T, w + r * row_bytes, nb, xq, xd);                         \
        y[r] = bias ? o + bias[r] : o;                                                                \
    }
#define ROWSK(T, XT)                                                                                  \
    for (int64_t r = r0; r < r1; r++) {                                                               \
        float o = row1_kquant(sizeof(XT) * 8, T, w + r * row_bytes, nb, xq, xd, xs);                  \
        y[r] = bias ? o + bias[r] : o;                                                                \
    }
#define TYPE_CASES(FN, XT)                                                                            \
    switch (type) {                                                                                   \
    case T_Q8_0: ROWS32(T_Q8_0, XT) break;                                                            \
    case T_Q5_0: ROWS32(T_Q5_0, XT) break;                                                            \
    case T_Q4_0: ROWS32(T_Q4_0, XT) break;                                                            \
    case T_Q4_1: ROWS_ONE(FN, T_Q4_1, XT) break;                                                      \
    case T_Q4_K: ROWSK(T_Q4_K, XT) break;                                                             \
    case T_Q6_K: ROWSK(T_Q6_K, XT) break;                                                             \
    }
static void rows_one(int act_bits, int type, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t k, int64_t r0,
                     int64_t r1, const void *xq, const float *xd, const float *xs, const float *bias, float *y) {
    if (act_bits == 8) {
        TYPE_CASES(row_q8, int8_t)
    } else {
        TYPE_CASES(row_q16, int16_t)
    }
}
#undef TYPE_CASES
#undef ROWS32
#undef ROWSK
#undef ROWS_ONE
#endif

/* ------------------------------------------------------------------ drivers */

/* Most weights one mi_matmul_many call takes (q, k and v). */
#define MAX_TENSORS 4

/* Products of one input x (m, k) float32 with nt weights W_t (ns[t], k), each stored as
 * types[t] blocks at ws[t], rows contiguous: y_t = x @ W_t^T (+ biases[t], (ns[t],) float32,
 * when biases and biases[t] are not NULL), written as (m, ns[t]) float32 at y + m * off_t,
 * off_t = ns[0] + ... + ns[t - 1].
 * act_bits 32 multiplies float32 activations (the gguf precision); 8 or 16 rounds each row of
 * x per 32 columns to int8 / int16 (quantize_blocks) once for all the weights, then takes
 * integer dot products (gguf-a8 / gguf-a16). One thread team covers the rows of all the
 * weights, so that a decode step's q, k and v (or gate and up) cost one call: the 128-row k and
 * v share the threads instead of running alone on one.
 * A row's result does not depend on m, on the other weights or on the thread count.
 * Returns 0; -1 for nt outside 1..MAX_TENSORS, act_bits other than 8, 16 and 32, a type the
 * mode does not take (mi_supports; mi_supports_q8 for 8 and 16) or a k that is not a multiple
 * of a type's block size; -2 when memory for the rounded rows cannot be had. */
/* One mi_matmul_many call, as its chunks of output rows see it. */
typedef struct {
    int act_bits, nt, mm;
    const int *types, *qk, *bytes;
    const deq_fn *fn;
    const uint8_t *const *ws;
    const int64_t *ns, *start;
    const float *const *biases;
    int64_t k, m, i0, total, xb;
    const float *x, *d, *s;
    const void *q;
    float *y;
} product;

#ifdef MI_AVX2
/* Chunk c (ROWS_PER_CHUNK output rows, counted across the weights) of a one-row product with
 * integer activations: rows_one per weight the chunk covers (a decode step). */
static void decode_chunk(const product *p, int64_t c) {
    int64_t g = c * ROWS_PER_CHUNK, end = g + ROWS_PER_CHUNK < p->total ? g + ROWS_PER_CHUNK : p->total;
    int t = 0;
    while (g < end) { /* a chunk may end one weight's rows and start the next's */
        while (g >= p->start[t + 1]) t++;
        int64_t stop = end < p->start[t + 1] ? end : p->start[t + 1], nb = p->k / p->qk[t];
        rows_one(p->act_bits, p->types[t], p->ws[t], nb * p->bytes[t], nb, p->k, g - p->start[t], stop - p->start[t],
                 p->q, p->d, p->s, p->biases ? p->biases[t] : NULL, p->y + p->start[t]);
        g = stop;
    }
}
#endif

/* Chunk c of input rows i0 .. i0 + mm - 1 (at most MAX_ROWS) against ROWS_PER_CHUNK output rows. */
static void rows_chunk(const product *p, int64_t c) {
    int64_t end = (c + 1) * ROWS_PER_CHUNK < p->total ? (c + 1) * ROWS_PER_CHUNK : p->total;
    int64_t k = p->k, i0 = p->i0, xb = p->xb;
    int mm = p->mm, act_bits = p->act_bits;
    for (int64_t g = c * ROWS_PER_CHUNK; g < end; g++) {
        int t = 0;
        while (g >= p->start[t + 1]) t++;
        int64_t r = g - p->start[t], n = p->ns[t], nb = k / p->qk[t];
        const uint8_t *wr = p->ws[t] + r * nb * p->bytes[t];
        float out[MAX_ROWS];
        if (act_bits == 32) {
            row_dots(p->types[t], wr, nb, p->qk[t], p->bytes[t], p->fn[t], p->x + i0 * k, k, mm, out);
        }
#ifndef MI_AVX2
        else {
            row_int(act_bits, p->types[t], wr, nb, p->qk[t], p->bytes[t], k, mm,
                    (const char *)p->q + i0 * k * (act_bits / 8), p->d + i0 * xb, p->s + i0 * xb, xb, out);
        }
#else
        else if (act_bits == 8) { /* a constant m = 1: the accumulator stays in a register */
            const int8_t *xq = (const int8_t *)p->q + i0 * k;
            if (mm == 1)
                row_q8(p->types[t], wr, nb, k, 1, xq, p->d + i0 * xb, p->s + i0 * xb, xb, out);
            else
                row_q8(p->types[t], wr, nb, k, mm, xq, p->d + i0 * xb, p->s + i0 * xb, xb, out);
        } else {
            const int16_t *xq = (const int16_t *)p->q + i0 * k;
            if (mm == 1)
                row_q16(p->types[t], wr, nb, k, 1, xq, p->d + i0 * xb, p->s + i0 * xb, xb, out);
            else
                row_q16(p->types[t], wr, nb, k, mm, xq, p->d + i0 * xb, p->s + i0 * xb, xb, out);
        }
#endif
        float *yt = p->y + p->m * p->start[t];
        const float *bias = p->biases ? p->biases[t] : NULL;
        for (int i = 0; i < mm; i++) yt[(i0 + i) * n + r] = bias ? out[i] + bias[r] : out[i];
    }
}

typedef void (*chunk_fn)(const product *, int64_t);

#ifndef _OPENMP
#include <pthread.h>
/* Weights (rows x columns, all of a call's weights) from which a product without OpenMP starts
 * POSIX threads. Threads are started per call (no pool), about 0.1 ms: measured on the 2-core
 * EPYC, a 4864 x 896 int8 product took 0.57 ms on 2 such threads and 0.50 ms on one, and the
 * 151936 x 896 output head 11.5 ms against 14.3 ms (2026-12-03). So a decode step's output
 * head gets every thread and its layer products one. */
#define POSIX_MIN_WEIGHTS (1LL << 25)

/* A chunk loop shared by the threads: each takes the next run of ceil(left / threads) chunks
 * (see run_chunks) until none is left. */
typedef struct {
    chunk_fn fn;
    const product *p;
    int64_t n, next;
    int threads;
} chunk_loop;

static void *chunk_worker(void *arg) {
    chunk_loop *l = (chunk_loop *)arg;
    int64_t c = __atomic_load_n(&l->next, __ATOMIC_RELAXED), run;
    for (;;) {
        if (c >= l->n) return NULL;
        run = (l->n - c + l->threads - 1) / l->threads;
        if (__atomic_compare_exchange_n(&l->next, &c, c + run, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            for (int64_t i = c; i < c + run; i++) l->fn(l->p, i);
            c = __atomic_load_n(&l->next, __ATOMIC_RELAXED);
        } /* else c now holds the value another thread left: try again from there */
    }
}
#endif

/* fn(p, c) for each chunk c in [0, n), on up to nthreads threads taking runs of consecutive
 * chunks, each run ceil(left / nthreads) of the chunks not yet taken (OpenMP's guided
 * schedule): on two threads the first run is half the product, the next a quarter, and so on.
 * So each thread reads the weights as one long stream, which the hardware prefetchers follow,
 * and the runs shrink toward the end so that the threads finish together. Taking one chunk at a
 * time (the schedule until 2026-12-04) interleaved the threads' chunks: on the 2-core EPYC the
 * whole model's int8 products took 1.09-1.13x the time, and whole gguf-a8 decode steps
 * 1.07-1.17x (docs/performance.md, "Long streams"). A thread the OS deschedules holds up the
 * run it took (up to half of a two-thread product; with one chunk at a time the other thread
 * took every chunk left).
 * OpenMP's threads where the compiler has OpenMP; else POSIX threads started for the call
 * (Apple's clang has no OpenMP: without them a Mac peer's output head used one core; see
 * POSIX_MIN_WEIGHTS), taking runs the same way. Each output row is computed by one thread
 * alone, so neither the thread count nor the runs change a result. */
static void run_chunks(chunk_fn fn, const product *p, int64_t n, int nthreads) {
    if (nthreads > n) nthreads = (int)n;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads > 1 ? nthreads : 1) schedule(guided, 1)
    for (int64_t c = 0; c < n; c++) fn(p, c);
#else
    chunk_loop loop = {fn, p, n, 0, nthreads > 1 ? nthreads : 1};
    pthread_t threads[63];
    int started = 0;
    for (int t = 1; t < nthreads && started < 63; t++)
        if (pthread_create(&threads[started], NULL, chunk_worker, &loop) == 0) started++;
    chunk_worker(&loop); /* this thread takes chunks too; if no thread started, it takes them all */
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
#endif
}

/* Whether mi_matmul_many and mi_team_matmul_many take these weights: nt in 1..MAX_TENSORS,
 * act_bits 8, 16 or 32, types the mode takes, k a multiple of each block size, no negative
 * row count. Returns 0, or -1. */
int mi_team_check(int act_bits, int nt, const int *types, const int64_t *ns, int64_t k) {
    int qk, bytes;
    deq_fn fn;
    if (nt < 1 || nt > MAX_TENSORS || (act_bits != 8 && act_bits != 16 && act_bits != 32)) return -1;
    for (int t = 0; t < nt; t++)
        if (type_info(types[t], &qk, &bytes, &fn) || k % qk || ns[t] < 0 || (act_bits != 32 && !mi_supports_q8(types[t])))
            return -1;
    return 0;
}

int mi_matmul_many(int act_bits, int nt, const int *types, const uint8_t *const *ws, const int64_t *ns,
                   const float *const *biases, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
    int qk[MAX_TENSORS], bytes[MAX_TENSORS];
    deq_fn fn[MAX_TENSORS];
    int64_t start[MAX_TENSORS + 1];
    if (mi_team_check(act_bits, nt, types, ns, k)) return -1;
    start[0] = 0;
    for (int t = 0; t < nt; t++) {
        type_info(types[t], &qk[t], &bytes[t], &fn[t]);
        start[t + 1] = start[t] + ns[t];
    }
    int64_t total = start[nt], xb = k / 32;
    if (m <= 0 || total == 0) return 0;
    void *q = NULL;
    float *d = NULL, *s = NULL;
    if (act_bits != 32) {
        q = malloc((size_t)(m * k) * (act_bits == 8 ? 1 : 2));
        d = (float *)malloc((size_t)(m * xb) * sizeof(float));
        s = (float *)malloc((size_t)(m * xb) * sizeof(float));
        if (!q || !d || !s) {
            free(q), free(d), free(s);
            return -2;
        }
        quantize_blocks(x, m, k, act_bits == 8 ? 127 : 32767, q, d, s);
    }
    product p = {act_bits, nt, 0, types, qk, bytes, fn, ws, ns, start, biases, k, m, 0, total, xb, x, d, s, q, y};
    int64_t chunks = (total + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    int threads = total >= 2 * ROWS_PER_CHUNK ? nthreads : 1;
#ifndef _OPENMP
    if (total * k < POSIX_MIN_WEIGHTS) threads = 1; /* starting threads would cost more than they save */
#endif
#ifdef MI_AVX2
    if (m == 1 && act_bits != 32) { /* a decode step: one input row, integer activations */
        run_chunks(decode_chunk, &p, chunks, threads);
        free(q), free(d), free(s);
        return 0;
    }
#endif
    for (p.i0 = 0; p.i0 < m; p.i0 += MAX_ROWS) {
        p.mm = (int)(m - p.i0 < MAX_ROWS ? m - p.i0 : MAX_ROWS);
        run_chunks(rows_chunk, &p, chunks, threads);
    }
    free(q), free(d), free(s);
    return 0;
}

/* mi_matmul_many's products (the same bits: each output row computed alone, by the same chunk
 * functions) for a caller that is already a thread team: every thread of an OpenMP parallel
 * region calls it with the same arguments, and the chunks are shared out among them by
 * orphaned work-sharing (outside a parallel region, one thread computes everything). Why: a
 * decode step's whole stack of layers runs in one parallel region (step_ops.c,
 * mi_layers_step) instead of starting a team for each of its ~120 products and attentions,
 * each start waiting for a vCPU that went to sleep (docs/performance.md, "One team per step").
 * The weights must pass mi_team_check; q (m * k bytes at act_bits 8, twice that at 16), d and
 * s (m * k / 32 floats each) are scratch shared by the team (unused at act_bits 32). Ends with
 * the team's barrier. */
void mi_team_matmul_many(int act_bits, int nt, const int *types, const uint8_t *const *ws, const int64_t *ns,
                         const float *const *biases, int64_t k, const float *x, int64_t m, float *y, void *q,
                         float *d, float *s) {
    int qk[MAX_TENSORS], bytes[MAX_TENSORS];
    deq_fn fn[MAX_TENSORS];
    int64_t start[MAX_TENSORS + 1];
    start[0] = 0;
    for (int t = 0; t < nt; t++) {
        type_info(types[t], &qk[t], &bytes[t], &fn[t]);
        start[t + 1] = start[t] + ns[t];
    }
    int64_t total = start[nt], xb = k / 32;
    if (m <= 0 || total == 0) return;
    if (act_bits != 32) {
#pragma omp single
        quantize_blocks(x, m, k, act_bits == 8 ? 127 : 32767, q, d, s);
    }
    product p = {act_bits, nt, 0, types, qk, bytes, fn, ws, ns, start, biases, k, m, 0, total, xb, x, d, s, q, y};
    int64_t chunks = (total + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
#ifdef MI_AVX2
    if (m == 1 && act_bits != 32) {
#pragma omp for schedule(guided, 1)
        for (int64_t c = 0; c < chunks; c++) decode_chunk(&p, c);
        return;
    }
#endif
    for (p.i0 = 0; p.i0 < m; p.i0 += MAX_ROWS) {
        p.mm = (int)(m - p.i0 < MAX_ROWS ? m - p.i0 : MAX_ROWS);
#pragma omp for schedule(guided, 1)
        for (int64_t c = 0; c < chunks; c++) rows_chunk(&p, c);
    }
}

/* y (m, n) = x (m, k) @ W^T for one weight W (n, k) stored as `type` blocks: mi_matmul_many
 * with float32 activations (mi_matmul), int8 (mi_matmul_q8) or int16 (mi_matmul_q16), and its
 * return codes. */
int mi_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
    return mi_matmul_many(32, 1, &type, &w, &n, NULL, k, x, m, y, nthreads);
}

int mi_matmul_q8(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
    return mi_matmul_many(8, 1, &type, &w, &n, NULL, k, x, m, y, nthreads);
}

int mi_matmul_q16(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
    return mi_matmul_many(16, 1, &type, &w, &n, NULL, k, x, m, y, nthreads);
}

#ifdef MI_AVX2
/* One tile of a float32 product: NR weight rows (stride k) by MR input rows (stride k), k a
 * multiple of 8: out[a * MR + b] = w[a] . x[b]. NR * MR accumulators stay in registers (4 x 3
 * = 12 of the 16 ymm), so each step of 8 columns loads NR + MR vectors for NR * MR FMAs: the
 * register blocking of Goto & van de Geijn 2008 ("Anatomy of high-performance matrix
 * multiplication"), here on the dot-product form a few-row product needs. */
static inline __attribute__((always_inline)) void tile_f32(const float *w, const float *x, int64_t k,
                                                           int NR, int MR, float *out) {
    __m256 acc[8][3];
    for (int a = 0; a < NR; a++)
        for (int b = 0; b < MR; b++) acc[a][b] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 8) {
        __m256 xv[3];
        for (int b = 0; b < MR; b++) xv[b] = _mm256_loadu_ps(x + b * k + c);
        for (int a = 0; a < NR; a++) {
            __m256 wv = _mm256_loadu_ps(w + a * k + c);
            for (int b = 0; b < MR; b++) acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < NR; a++)
        for (int b = 0; b < MR; b++) out[a * MR + b] = hsum8(acc[a][b]);
}

/* Rows [r, r + NR) of W against all m rows of x, into y (m, n). */
static inline __attribute__((always_inline)) void rows_f32(const float *w, int64_t n, int64_t k, const float *x,
                                                           int64_t m, float *y, int64_t r, int NR) {
    float out[24];
    int64_t i = 0;
    for (; i + 3 <= m; i += 3) {
        tile_f32(w + r * k, x + i * k, k, NR, 3, out);
        for (int a = 0; a < NR; a++)
            for (int b = 0; b < 3; b++) y[(i + b) * n + r + a] = out[a * 3 + b];
    }
    if (m - i == 2) {
        tile_f32(w + r * k, x + i * k, k, NR, 2, out);
        for (int a = 0; a < NR; a++)
            for (int b = 0; b < 2; b++) y[(i + b) * n + r + a] = out[a * 2 + b];
    } else if (m - i == 1) {
        tile_f32(w + r * k, x + i * k, k, NR, 1, out);
        for (int a = 0; a < NR; a++) y[i * n + r + a] = out[a];
    }
}
#endif

#ifndef MI_AVX2
/* Row r of W against all m rows of x, into y (m, n): the portable form of rows_f32 (NEON, or
 * fmaf's in the same lanes and order). */
static void row_f32_portable(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int64_t r) {
    const float *wr = w + r * k;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * k;
#ifdef MI_NEON
        float32x4_t a0 = vdupq_n_f32(0), a1 = vdupq_n_f32(0);
        for (int64_t c = 0; c < k; c += 8) {
            a0 = vfmaq_f32(a0, vld1q_f32(wr + c), vld1q_f32(xr + c));
            a1 = vfmaq_f32(a1, vld1q_f32(wr + c + 4), vld1q_f32(xr + c + 4));
        }
        y[i * n + r] = neon_hsum8(a0, a1);
#else
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t c = 0; c < k; c += 8)
            for (int l = 0; l < 8; l++) a[l] = fmaf(wr[c + l], xr[c + l], a[l]);
        y[i * n + r] = hsum8(a);
#endif
    }
}
#endif

/* mi_matmul_f32's work for every thread of a team (see mi_team_matmul_many), k a multiple of 8
 * (the caller checks): the row groups shared out by orphaned work-sharing, the rows left over
 * by one thread. Ends with the team's barrier. */
void mi_team_matmul_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
#ifdef MI_AVX2
    if (m == 1) { /* memory-bound: 8 rows in flight keep more loads outstanding */
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK / 8) nowait
        for (int64_t g = 0; g < n / 8; g++) rows_f32(w, n, k, x, 1, y, 8 * g, 8);
#pragma omp single
        for (int64_t r = 8 * (n / 8); r < n; r++) rows_f32(w, n, k, x, 1, y, r, 1);
        return;
    }
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK / 4) nowait
    for (int64_t g = 0; g < n / 4; g++) rows_f32(w, n, k, x, m, y, 4 * g, 4);
#pragma omp single
    for (int64_t r = 4 * (n / 4); r < n; r++) rows_f32(w, n, k, x, m, y, r, 1);
#else
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t r = 0; r < n; r++) row_f32_portable(w, n, k, x, m, y, r);
#endif
}

/* y (m, n) = x (m, k) @ W^T for float32 W (n, k), x (m, k), y (m, n), all contiguous: the f32
 * precision's decode and verification products (a few rows), and a gguf precision's float32
 * rows. Output rows are split over the threads, so a one-row product (memory-bound) reads the
 * weight with every core. Each output is 8 lanes of fused multiply-adds over the columns, 8 at
 * a time, summed as hsum8 sums them; without AVX2 the same operations (fmaf, or NEON), so every
 * build gives the same bits. Returns 0, or -1 for a k that is not a multiple of 8 (the caller
 * then uses torch). */
int mi_matmul_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
    if (k % 8 || k <= 0) return -1;
#pragma omp parallel num_threads(n >= 2 * ROWS_PER_CHUNK ? nthreads : 1)
    mi_team_matmul_f32(w, n, k, x, m, y);
    return 0;
}

/* out (m, k) = x rounded as the integer kernels round their activations (round_block, as
 * quantize_blocks): per 32 columns d = max|x| / L (L = 127 for bits 8, 32767 for 16),
 * q = round(x / d) clamped to [-L, L], out = q * d; a block holding a NaN gives NaN throughout. The dense
 * (prefill) path multiplies this in float32, so a row gets the kernels' rounding whichever path
 * its pass takes. Returns 0, or -1 for bits other than 8 and 16 or a k that is not a
 * multiple of 32. */
int mi_round_activations(const float *x, int64_t m, int64_t k, int bits, float *out, int nthreads) {
    if ((bits != 8 && bits != 16) || k % 32) return -1;
    int lim = bits == 8 ? 127 : 32767;
    int64_t blocks = m * (k / 32);
#pragma omp parallel for num_threads(blocks >= 4096 ? nthreads : 1) schedule(static)
    for (int64_t i = 0; i < blocks; i++) {
#ifdef MI_AVX2
        __m256 q[4];
        const __m256 vd = _mm256_set1_ps(round_block(x + i * 32, lim, q));
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + i * 32 + 8 * j, _mm256_mul_ps(q[j], vd));
#else
        int32_t q[32];
        float d = round_block(x + i * 32, lim, q);
        for (int j = 0; j < 32; j++) out[i * 32 + j] = (float)q[j] * d;
#endif
    }
    return 0;
}
