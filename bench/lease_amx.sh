#!/usr/bin/env bash
# The AMX table in one lease of the 16-core device (Intel Xeon with AMX, no package registry, ~10 minutes a call):
# run it from the repository root there, with the sources and wheels bench/pack_offline_src.sh packed here
# carried beside the checkout:
#   here:   bash bench/pack_offline_src.sh .offsrc <ik_llama.cpp clone>    (and `echo /.offsrc/ >> .git/info/exclude`)
#   there:  bash bench/lease_amx.sh [.offsrc]                              (the device tool: carry .offsrc)
# Phases, in order, each stopped at DEADLINE (default 520 s from the start; the call's limit is 600):
#   ktests        the kernel tests with the hardware tiles, beside the builds (ours, llama.cpp, ik_llama.cpp)
#   tiles=2@0-1   bench_tiles.py on 2 pinned CPUs: peaks, GEMMs and heads at M = 1..512 tiles on / off, the
#                 crossover, k-blocks, the streamed small-M body at 16-32 rows, the weight warm at 16 and 128
#                 rows (weights from memory); then pp512, batched 1 / 16, bitnet serve at 16 clients, the peers'
#                 pp512
#   parts=2@0-1   bench/prefill_parts.py: a tile prefill kernel by kernel; bench/batch_depth.py --parts: a batched step
#   tiles=16      the same at 16 threads (two shapes), pp512 and pp4096, batched 16 / 32, the peers' pp512 / pp4096
#   parts=16, prefetch=2@0-1   if time is left
#   cli=2@0-1     (the second call) `bitnet bench` pp512 / tg128 at 1 and 16 sequences, tiles on and off
# PHASES="..." runs others; with REUSE=1 (a second call while the machine is still warm) the peers' binaries and
# the models stay and ours is rebuilt only if its sources changed (bench/sweep_offline.sh).
# Output under $OUT (the device tool's folder; default ./lease-out): machine.txt, sweep.log and the tables
# (tiles_*.md, parts_*.md, prefetch_2.md, ktests.log), and all.tgz with every log and JSON. Copy the tables into
# bench/TILES_RESULTS.md and the figures into docs/performance.md (issue: tiles on AMX).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:-$root/.offsrc}"
out="${OUT:-$root/lease-out}"
res=/tmp/lease-res
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1
{
    lscpu
    grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort | uniq -c
    uname -r
    free -g
    python3 -c 'import numpy, Cython, setuptools; print("numpy", numpy.__version__, "Cython", Cython.__version__,
                "setuptools", setuptools.__version__)'
} > "$res/machine.txt" 2>&1
cd "$root" || exit 1
tiles_2="--ms 1,4,8,16,32,64,128,512 --min-time 0.15 --kblock-ms 16,128 --stream-ms 16,32 --warm-ms 16,128 --overlap-ms 16,128,512"
tiles_2+=" --prompts 512"
tiles_2+=" --seqs 1,16 --peer-prompts 512 --serve-gen 64"
tiles_16="--quick --kblock-ms 16,512 --stream-ms 16,32 --warm-ms 16 --overlap-ms 16,128 --prompts 512,4096 --seqs 16,32 --no-serve"
# shellcheck disable=SC2086
SRC="$src" OUT="$res" DEADLINE="${DEADLINE:-520}" BUILD_CPUS="${BUILD_CPUS:-2-15}" JOBS="${JOBS:-14}" \
    KTESTS_ARGS="${KTESTS_ARGS:--n 6}" KTESTS_TIMEOUT="${KTESTS_TIMEOUT:-150}" \
    TILES_ARGS_2="${TILES_ARGS_2:-$tiles_2}" TILES_ARGS_16="${TILES_ARGS_16:-$tiles_16}" \
    timeout "${LEASE_TIMEOUT:-560}" bash bench/sweep_offline.sh \
    ${PHASES:-ktests tiles=2@0-1 parts=2@0-1 tiles=16 parts=16 prefetch=2@0-1} \
    > "$res/sweep.log" 2>&1
echo "sweep exit $?" >> "$res/sweep.log"
head -25 "$res/machine.txt"
tail -200 "$res/sweep.log"
for f in machine.txt sweep.log ktests.log tiles_2.md tiles_16.md parts_2.md parts_16.md prefetch_2.md cli_2.md; do
    [[ -f "$res/$f" ]] && cp "$res/$f" "$out/"
done
(cd "$res" && tar czf "$out/all.tgz" --exclude='*.gguf' --exclude='*.bnstore' .)
ls -la "$out"
