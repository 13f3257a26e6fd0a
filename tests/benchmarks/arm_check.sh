#!/usr/bin/env bash
# The C kernels on an Arm CPU, from an x86 machine: build tests/benchmarks/arm_check.c with the
# kernels for this machine (-march=native: AVX2 where it has it) and for aarch64 (their NEON
# path: gcc for armv8.2-a with dotprod, as a Graviton 2, and plain armv8-a; clang for Apple's
# M1 and plain armv8-a), run the aarch64 builds under qemu-user, and compare the printed hashes:
# every product, rounding and step operation must give the same bits ("simd 1" is AVX2, "simd
# 2" NEON). Exit 0 when they all agree. This checks bits, not speed (qemu emulates).
#
# Needs (Debian): gcc-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user;
# clang too for the clang builds (Apple's compiler is a clang), else they are left out.
# Usage: bash tests/benchmarks/arm_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
k=$root/meshinfer/engine/kernels
src=("$k/gguf_blocks.c" "$k/step_ops.c" "$root/tests/benchmarks/arm_check.c")
flags=(-O3 -fopenmp -pthread -ffp-contract=off -std=c11)  # the library's flags (native.py CFLAGS) less -march
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sysroot=/usr/aarch64-linux-gnu

cc "${flags[@]}" -march=native "${src[@]}" -lm -o "$out/native"
"$out/native" | tail -n +2 > "$out/native.txt"
echo "native ($(head -1 < <("$out/native"))): $(wc -l < "$out/native.txt") results"
status=0
check() {  # name, flags, then the compiler command line
    local name=$1 fl=$2
    shift 2
    "$@" $fl "${src[@]}" -lm -o "$out/$name"
    qemu-aarch64 -L "$sysroot" "$out/$name" > "$out/$name.all"
    tail -n +2 "$out/$name.all" > "$out/$name.txt"
    if diff -q "$out/native.txt" "$out/$name.txt" > /dev/null; then
        echo "$name ($(head -1 "$out/$name.all")): the same bits"
    else
        echo "$name ($(head -1 "$out/$name.all")): DIFFERENT"
        diff "$out/native.txt" "$out/$name.txt" || true
        status=1
    fi
}
check gcc-armv8.2-dotprod "${flags[*]}" aarch64-linux-gnu-gcc -march=armv8.2-a+dotprod
check gcc-armv8-a "${flags[*]}" aarch64-linux-gnu-gcc -march=armv8-a
if command -v clang > /dev/null; then
    # without -fopenmp, as Apple's clang builds it (native.py's first fallback): one thread
    target=(clang --target=aarch64-linux-gnu --ld-path=/usr/bin/aarch64-linux-gnu-ld)
    check clang-apple-m1 "${flags[*]/-fopenmp/}" "${target[@]}" -mcpu=apple-m1
    check clang-armv8-a "${flags[*]/-fopenmp/}" "${target[@]}" -march=armv8-a
fi
exit $status
