#!/usr/bin/env bash
# Instructions per weight byte of each decode kernel on each path, counted under qemu-user (repeatable where
# seconds are not, and no ARM machine is needed): the NEON / sdot / smmla bodies next to the AVX2 ones, the same
# source and shapes (512 x 2560, one thread). Needs gcc, aarch64-linux-gnu-gcc and qemu-user-static (Debian).
#   bench/arm64/insn_per_byte.sh            # prints a table of every kernel
#   bench/arm64/insn_per_byte.sh gemm att8  # only those (ternary q4g tg b3 i8 gemm att16 att8 silu rope kvf16)
# What it is not: a speed. An instruction count says nothing of latency, ports or memory bandwidth.
set -euo pipefail
cd "$(dirname "$0")/../.."
K=simd/kernels
O=simd/ops
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
FLAGS="-O3 -pthread -ffp-contract=off -std=c11 -static -I$K -I$O"
aarch64-linux-gnu-gcc $FLAGS bench/arm64/insn_per_byte.c $K/*.c $O/*.c -o "$TMP/a64" -lm
gcc $FLAGS bench/arm64/insn_per_byte.c $K/*.c $O/*.c -o "$TMP/x86" -lm
count() { # emulator binary kernel isa reps -> executed instructions
  "$1" -cpu max -singlestep -d exec,nochain "$2" "$3" "$4" "$5" 2>&1 >/dev/null | grep -c '^Trace'
}
printf "%-8s %-8s %12s %10s\n" kernel path insn/call insn/byte
paths_of() { # the paths with a body of their own for that kernel
  case "$1" in
    gemm) echo "x86:avx2:1 a64:neon:3 a64:dotprod:5 a64:i8mm:6" ;;
    att16|silu|rope|kvf16) echo "x86:avx2:1 a64:neon:3" ;; # dotprod runs the same float bodies
    *) echo "x86:avx2:1 a64:neon:3 a64:dotprod:5" ;;
  esac
}
for kern in ${@:-ternary q4g tg b3 i8 gemm att16 att8 silu rope kvf16}; do
  for path in $(paths_of "$kern"); do
    IFS=: read -r -a parts <<<"$path"
    set -- "${parts[@]}"
    emu=$( [ "$1" = x86 ] && echo qemu-x86_64-static || echo qemu-aarch64-static )
    bytes=$("$emu" -cpu max "$TMP/$1" "$kern" "$3" 1)
    c1=$(count "$emu" "$TMP/$1" "$kern" "$3" 1)
    c2=$(count "$emu" "$TMP/$1" "$kern" "$3" 2)
    awk -v k="$kern" -v p="$2" -v d=$((c2 - c1)) -v b="$bytes" 'BEGIN { printf "%-8s %-8s %12d %10.3f\n", k, p, d, d / b }'
  done
done
