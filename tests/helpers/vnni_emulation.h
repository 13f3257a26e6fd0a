/* VNNI's two dot-product instructions in plain C, for a test build of the kernels on a CPU
 * without VNNI: given to meshinfer/engine/kernels/gguf_blocks.c with `-include`, it defines
 * MI_VNNI_EMULATION, and the kernels' VNNI path calls these where a VNNI CPU runs the
 * instructions (tests/test_gguf_kernels.py). Each follows its instruction's definition in
 * Intel's Software Developer's Manual (volume 2, VPDPBUSD and VPDPWSSD, the non-saturating
 * forms): for each int32 lane j,
 *   VPDPBUSD: acc[j] + sum over i < 4 of ZeroExtend(a.byte[4j + i]) * SignExtend(b.byte[4j + i])
 *   VPDPWSSD: acc[j] + sum over i < 2 of SignExtend(a.word[2j + i]) * SignExtend(b.word[2j + i])
 * wrapping modulo 2^32. tests/benchmarks/vnni_check.sh compares them with SIMDe's emulation. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MI_VNNI_EMULATION 1

static inline __m256i mi_dpbusd(__m256i acc, __m256i a, __m256i b) {
    uint8_t ua[32];
    int8_t sb[32];
    uint32_t d[8];
    memcpy(ua, &a, 32), memcpy(sb, &b, 32), memcpy(d, &acc, 32);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) d[j] += (uint32_t)((int32_t)ua[4 * j + i] * (int32_t)sb[4 * j + i]);
    memcpy(&acc, d, 32);
    return acc;
}

static inline __m256i mi_dpwssd(__m256i acc, __m256i a, __m256i b) {
    int16_t sa[16], sb[16];
    uint32_t d[8];
    memcpy(sa, &a, 32), memcpy(sb, &b, 32), memcpy(d, &acc, 32);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 2; i++) d[j] += (uint32_t)((int32_t)sa[2 * j + i] * (int32_t)sb[2 * j + i]);
    memcpy(&acc, d, 32);
    return acc;
}
