#!/usr/bin/env bash
# The C kernels' VNNI path (AVX512-VNNI or AVX-VNNI: vpdpbusd / vpdpwssd in place of maddubs +
# madd) on an x86 machine without VNNI. Build tests/benchmarks/arm_check.c with the kernels three
# ways: for this machine (AVX2, maddubs + madd), with VNNI's two instructions emulated by
# tests/helpers/vnni_emulation.h (what the tests build), and emulated by SIMDe (an independent
# library's emulation of the same instructions), run them, and compare the printed hashes:
# every product, rounding and step operation must give the same bits. Then build the kernels for
# an AVX512-VNNI CPU (-march=icelake-server) and an AVX-VNNI one (-march=alderlake) and count
# the instructions in their assembly. Exit 0 when all agree. This checks bits, not speed.
#
# Needs (Debian): libsimde-dev. Usage: bash tests/benchmarks/vnni_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
k=$root/meshinfer/engine/kernels
src=("$k/gguf_blocks.c" "$k/step_ops.c" "$root/tests/benchmarks/arm_check.c")
flags=(-O3 -march=native -fopenmp -pthread -ffp-contract=off -std=c11)  # the library's flags (native.py CFLAGS)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cat > "$out/simde_vnni.h" <<'H'
#include <simde/x86/avx512/dpbusd.h>
#include <simde/x86/avx512/dpwssd.h>
#define MI_VNNI_EMULATION 1
static inline __m256i mi_dpbusd(__m256i acc, __m256i a, __m256i b) { return simde_mm256_dpbusd_epi32(acc, a, b); }
static inline __m256i mi_dpwssd(__m256i acc, __m256i a, __m256i b) { return simde_mm256_dpwssd_epi32(acc, a, b); }
H
cc "${flags[@]}" "${src[@]}" -lm -o "$out/native"
"$out/native" | tail -n +2 > "$out/native.txt"
echo "native (AVX2, maddubs + madd): $(wc -l < "$out/native.txt") results"
status=0
for emulation in "$root/tests/helpers/vnni_emulation.h" "$out/simde_vnni.h"; do
    name=$(basename "$emulation" .h)
    cc "${flags[@]}" -include "$emulation" "${src[@]}" -lm -o "$out/$name"
    "$out/$name" | tail -n +2 > "$out/$name.txt"
    if diff -q "$out/native.txt" "$out/$name.txt" > /dev/null; then
        echo "VNNI path, $name: the same bits"
    else
        echo "VNNI path, $name: DIFFERENT"
        diff "$out/native.txt" "$out/$name.txt" || true
        status=1
    fi
done
for march in icelake-server alderlake; do
    cc "${flags[@]/-march=native/-march=$march}" -S "$k/gguf_blocks.c" -o "$out/$march.s"
    b=$(grep -c vpdpbusd "$out/$march.s" || true) w=$(grep -c vpdpwssd "$out/$march.s" || true)
    echo "-march=$march: $b vpdpbusd, $w vpdpwssd in the assembly"
    if [ "$b" = 0 ] || [ "$w" = 0 ]; then status=1; fi
done
exit $status
