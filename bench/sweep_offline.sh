#!/usr/bin/env bash
# Benchmarks on a machine with no package registry, leased for minutes (a 16-core box reached with carried
# sources): builds ours in place, llama.cpp's llama-bench from the llama-cpp-python sdist's vendored sources and
# ik_llama.cpp's llama-bench + llama-quantize from a source tarball, all in parallel; generates the synthetic
# 2B-4T models (TQ2_0, our store, IQ2_BN for ik); then runs the phases named on the command line, in order:
#   threads          bench/bench_threads.py over all three engines, THREADS (default 1,2,4,8,12,16)
#   depth=T[@CPUS]   bench/depth_peers.py at T threads (pinned to CPUS with taskset), DEPTHS (default
#                    0,1024,4096,16384), PREFILL (default 0: none), ROUNDS (default 3); PEERS=1 adds llama.cpp and
#                    ik_llama.cpp at PEER_DEPTHS (default all), each of their runs capped at PEER_TIMEOUT s (default
#                    120). Each of these may be given per thread count: DEPTHS_16=... applies to depth=16 only.
#   tiles=T[@CPUS]   bench/bench_tiles.py at T threads (kernels, then --e2e with both peers): AMX tiles against
#                    vpdpbusd, the int8 peaks of both, the crossover per shape; tiles_T.json and tiles_T.md;
#                    TILES_ARGS (or TILES_ARGS_T) adds bench_tiles.py flags (--ms, --prompts, --seqs, --quick ...)
#   parts=T[@CPUS]   bench/prefill_parts.py at T threads: a prefill's time kernel by kernel, tiles on and off
#                    (PARTS_PROMPT tokens, default 512; PARTS_ARGS, default --chunks 128,512 --attention f32,bf16);
#                    parts_T.json, parts_T.md; then bench/batch_depth.py --parts: a batched step of BPARTS_SEQS
#                    (default 16) sequences at BPARTS_DEPTH (default 96) positions the same way, appended to
#                    parts_T.md (parts_batch_T.json)
#   prefetch=T[@CPUS] bench/bench_kernels.py --prefetch at T threads: the decode GEMVs at each software prefetch
#                    distance (PREFETCH, default 0,2048,4096,8192,16384) against the stream rate; prefetch_T.md
#   cli=T[@CPUS]     `bitnet bench` (the installed command users run) at T threads: pp512, tg128, both at 1 and 16
#                    sequences (CLI_ARGS adds flags), CLI_REPS (2) repetitions each, with the tiles on, then
#                    BITNET_ISA=avx512; cli_T.md. Lease 3's tiles half (3 repetitions) took ~250 s at 2 threads and
#                    the avx512 half is slower: a call of its own
#   ktests           the kernel tests (KTESTS, default: the kernels, attention (f32, bf16) and tile tests) on this
#                    machine's ISA, in the background from when ours is built until the models are made, at most
#                    KTESTS_TIMEOUT s (default 240); no phase is timed while they run (their log: ktests.log)
#   usage: SRC=dir-with-carried-files OUT=results-dir [DEADLINE=s] [REUSE=1] bash bench/sweep_offline.sh [phase ...]
# No phase: threads. DEADLINE (seconds from the start): no phase starts past it, and each one is stopped there
# (the JSON a phase writes after every row keeps what it measured). HEAD (default q4; i8 converts faster) picks the
# store ours reads; BUILD_CPUS (taskset list) keeps the builds off the cores a pinned phase times.
# SRC holds what bench/pack_offline_src.sh packs: whl/*.whl, llama_cpp_python-*.tar.gz (the sdist, or just its
# vendor/llama.cpp build inputs under the same top folder), ik_src.tar.gz, ik_commit (for the table).
# Every step writes its log under $OUT; the thread sweep writes THREADS_RESULTS.md / threads_results.{json,png},
# a depth phase depth_T.json and its table in depth_T.md.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$(cd "${SRC:?carried sources}" && pwd)"; OUT="${OUT:?results dir}"; THREADS="${THREADS:-1,2,4,8,12,16}"
JOBS="${JOBS:-$(nproc)}"; HEAD="${HEAD:-q4}"; DEADLINE="${DEADLINE:-100000}"
py="${PYTHON:-python3}"
site=/tmp/sweep-site; work=/tmp/sweep-build
mkdir -p "$site" "$work" "$OUT"
phases=("$@"); [[ ${#phases[@]} -eq 0 ]] && phases=(threads)
if compgen -G "$SRC/whl/*.whl" > /dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$SRC"/whl/*.whl || exit 1
fi
# the checkout is the package bitnet_cpu (pyproject maps it to the root): import it through a link, no install
mkdir -p /tmp/sweep-pkg && ln -sfn "$root" /tmp/sweep-pkg/bitnet_cpu
export PYTHONPATH="/tmp/sweep-pkg:$site${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
left() { echo $((DEADLINE - (SECONDS - t0))); }
pin() {   # the taskset prefix for a CPU list (none where there is no taskset: then said, and run unpinned)
    [[ -n "${1:-}" ]] || return 0
    if command -v taskset > /dev/null; then echo "taskset -c $1"; else echo "no taskset: not pinned to $1" >&2; fi
}
# a phase's argument T[@CPUS] (what follows its "="): sets t (threads) and cpus (a taskset list, or empty)
phase_spec() { local spec="${1#*=}"; t="${spec%%@*}"; cpus=""; [[ "$spec" == *@* ]] && cpus="${spec#*@}"; }
# a phase's setting: NAME_T (T its thread count), else NAME, else the default
opt() { local v="${1}_$2"; v="${!v:-}"; [[ -n "$v" ]] || { v="${1}"; v="${!v:-$3}"; }; echo "$v"; }
depths=0,1024,4096,16384
build=$(pin "${BUILD_CPUS:-}")

# REUSE=1 (a second call on a machine still warm from the first): the peers' binaries and the models already
# made are kept, and ours is rebuilt only when its sources differ from the last build's (a hash of them)
reuse="${REUSE:-0}"
ik_ok() { [[ "$reuse" == 1 && -x "$work/ik/build/bin/llama-bench" && -x "$work/ik/build/bin/llama-quantize" ]]; }
# ik_llama.cpp, then its IQ2_BN file (written from the synthetic model, beside ours being made from TQ2_0)
( cd "$work" && { ik_ok && echo "ik kept (REUSE)" || {
  rm -rf ik && mkdir ik && tar xzf "$SRC/ik_src.tar.gz" -C ik && cd ik &&
  cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release &&
  $build cmake --build build -j "$JOBS" --target llama-bench llama-quantize; }; } &&
  echo "[$((SECONDS - t0)) s] ik built; IQ2_BN" &&
  $build $py "$root/bench/make_models.py" --only-ik --ik-quantize "$work/ik/build/bin/llama-quantize" &&
  echo "[$((SECONDS - t0)) s] IQ2_BN written" ) > "$OUT/ik_build.log" 2>&1 &
ik_pid=$!
# llama.cpp: its own llama-bench, built from the llama-cpp-python sdist's vendored sources (the Python binding
# built on such a machine crashed in llama_model_load; llama-bench times the same library code)
if [[ "$reuse" == 1 && -x "$work/llama/build/bin/llama-bench" ]]; then
    echo "llama.cpp kept (REUSE)" > "$OUT/llama_build.log"; llama_pid=""
else
( cd "$work" && rm -rf llama && mkdir llama && tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C llama &&
  cmake -S llama/*/vendor/llama.cpp -B llama/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DCMAKE_BUILD_TYPE=Release &&
  $build cmake --build llama/build -j "$JOBS" --target llama-bench ) > "$OUT/llama_build.log" 2>&1 &
llama_pid=$!
fi

cd "$root"
src_hash=$(find simd setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.pyx' -o -name '*.pxi' -o -name '*.py' \) \
           ! -name '_kernels.c' ! -name '_probes.c' ! -name '_faultguard.c' | sort | xargs cat | sha1sum | cut -c1-16)
if [[ "$reuse" == 1 && "$(cat "$work/ours.hash" 2>/dev/null)" == "$src_hash" ]] &&
   $py -c 'from bitnet_cpu.simd import _kernels' 2> /dev/null; then
    stamp "ours kept (REUSE: the sources are the last build's)"
else
    stamp "building ours"
    $build $py setup.py build_ext --inplace -j "$JOBS" > "$OUT/ours_build.log" 2>&1 ||
        { tail "$OUT/ours_build.log"; exit 1; }
    echo "$src_hash" > "$work/ours.hash"
fi
stamp "ours built: path $($py -c 'from bitnet_cpu.simd import _kernels as K; print(K.active())')"
$py -m bitnet_cpu info > "$OUT/bitnet_info.txt" 2>&1   # the path, the tiles and how their bodies run
if [[ " ${phases[*]} " == *" ktests "* ]]; then
    ktests=${KTESTS:-tests/test_kernels.py tests/test_attention_paths.py tests/test_attention_bf16.py tests/test_tiles.py tests/test_tiles_q4.py}
    # shellcheck disable=SC2086
    ( timeout "${KTESTS_TIMEOUT:-240}" $build $py -m pytest -q -p no:cacheprovider -rs ${KTESTS_ARGS:-} $ktests \
        > "$OUT/ktests.log" 2>&1; echo "exit $?" >> "$OUT/ktests.log" ) &
    kt_pid=$!
fi
stamp "generating 2B-4T models (our store: $HEAD head)"
$build $py bench/make_models.py --no-f16 --heads "$HEAD" 2>&1 | tail -4
wait $ik_pid || { stamp "ik build or its IQ2_BN file failed"; tail -5 "$OUT/ik_build.log"; }
ikb="$work/ik/build/bin"
[[ -z "$llama_pid" ]] || wait "$llama_pid" || { stamp "llama.cpp build failed"; tail -5 "$OUT/llama_build.log"; }
if [[ -n "${kt_pid:-}" ]]; then wait $kt_pid; stamp "kernel tests: $(tail -2 "$OUT/ktests.log" | tr '\n' ' ')"; fi
store="bench/cache/2b4t.$HEAD.bnstore"
for ph in "${phases[@]}"; do
    (( $(left) > 20 )) || { stamp "deadline: $ph and the phases after it not run"; break; }
    case "$ph" in
    ktests) ;;
    threads)
        stamp "thread sweep"
        sdist="$(basename "$SRC"/llama_cpp_python-*.tar.gz .tar.gz)"
        LLAMA_VERSION="llama.cpp vendored in llama-cpp-python ${sdist#llama_cpp_python-}, its llama-bench" \
            IK_LLAMA_VERSION="ik_llama.cpp $(cat "$SRC/ik_commit" 2>/dev/null || echo '?')" PYTHONUNBUFFERED=1 \
            timeout "$(left)" $py bench/bench_threads.py --threads "$THREADS" --engines ours,llama,ik \
            --ik-bench "$ikb/llama-bench" --llama-bench "$work/llama/build/bin/llama-bench" --store "$store" \
            --no-busy --out "$OUT" ;;
    depth=*)
        phase_spec "$ph"
        peers=()
        if [[ "$(opt PEERS "$t" 0)" == 1 ]]; then    # the peers that built
            [[ -x "$work/llama/build/bin/llama-bench" ]] && peers+=(--llama-bench "$work/llama/build/bin/llama-bench")
            [[ -x "$ikb/llama-bench" ]] && peers+=(--ik-bench "$ikb/llama-bench")
            peers+=(--peer-depths "$(opt PEER_DEPTHS "$t" "$(opt DEPTHS "$t" "$depths")")")
        fi
        stamp "depth sweep at $t threads${cpus:+ on CPUs $cpus}"
        PYTHONUNBUFFERED=1 timeout "$(left)" $(pin "$cpus") $py bench/depth_peers.py --threads "$t" --head "$HEAD" \
            --depths "$(opt DEPTHS "$t" "$depths")" --prefill "$(opt PREFILL "$t" 0)" --rounds "$(opt ROUNDS "$t" 3)" \
            --timeout "$(opt PEER_TIMEOUT "$t" 120)" "${peers[@]}" --json "$OUT/depth_$t.json" \
            > "$OUT/depth_$t.md" 2> "$OUT/depth_$t.log"
        if [[ ! -s "$OUT/depth_$t.md" && -f "$OUT/depth_$t.json" ]]; then    # stopped at the deadline
            $py bench/depth_peers.py --report "$OUT/depth_$t.json" > "$OUT/depth_$t.md"
        fi
        cat "$OUT/depth_$t.md" ;;
    tiles=*)
        phase_spec "$ph"
        stamp "tiles against vpdpbusd at $t threads${cpus:+ on CPUs $cpus}"
        # shellcheck disable=SC2046
        PYTHONUNBUFFERED=1 timeout "$(left)" $(pin "$cpus") $py bench/bench_tiles.py --threads "$t" --e2e \
            $(opt TILES_ARGS "$t" "") --store "$store" --llama-bench "$work/llama/build/bin/llama-bench" \
            --ik-bench "$ikb/llama-bench" \
            --json "$OUT/tiles_$t.json" > "$OUT/tiles_$t.md" 2> "$OUT/tiles_$t.log"
        cat "$OUT/tiles_$t.md" ;;
    parts=*)
        phase_spec "$ph"
        stamp "prefill kernel by kernel at $t threads${cpus:+ on CPUs $cpus}"
        # shellcheck disable=SC2086
        PYTHONUNBUFFERED=1 timeout "$(left)" $(pin "$cpus") $py bench/prefill_parts.py --threads "$t" --store "$store" \
            --prompt "${PARTS_PROMPT:-512}" ${PARTS_ARGS:---chunks 128,512 --attention f32,bf16} --json "$OUT/parts_$t.json" \
            > "$OUT/parts_$t.md" 2> "$OUT/parts_$t.log"
        # shellcheck disable=SC2046
        PYTHONUNBUFFERED=1 timeout "$(left)" $(pin "$cpus") $py bench/batch_depth.py --parts --threads "$t" \
            --store "$store" --seqs "${BPARTS_SEQS:-16}" --depth "${BPARTS_DEPTH:-96}" --kv f16 --rounds 3 --steps 4 \
            --json "$OUT/parts_batch_$t.json" >> "$OUT/parts_$t.md" 2>> "$OUT/parts_$t.log"
        cat "$OUT/parts_$t.md" ;;
    prefetch=*)
        phase_spec "$ph"
        stamp "decode GEMV prefetch distances at $t threads${cpus:+ on CPUs $cpus}"
        PYTHONUNBUFFERED=1 timeout "$(left)" $(pin "$cpus") $py bench/bench_kernels.py --threads "$t" \
            --prefetch "${PREFETCH:-0,2048,4096,8192,16384}" > "$OUT/prefetch_$t.md" 2> "$OUT/prefetch_$t.log"
        cat "$OUT/prefetch_$t.md" ;;
    cli=*)
        phase_spec "$ph"
        stamp "bitnet bench at $t threads${cpus:+ on CPUs $cpus}, tiles on then BITNET_ISA=avx512"
        : > "$OUT/cli_$t.md"
        for isa in auto avx512; do
            echo "BITNET_ISA=$isa" >> "$OUT/cli_$t.md"
            # shellcheck disable=SC2046,SC2086
            env $( [[ $isa == auto ]] || echo BITNET_ISA=$isa ) timeout "$(left)" $(pin "$cpus") $py -m bitnet_cpu bench \
                -m "$store" -t "$t" -p 512 -n 128 -npl 1,16 -r "${CLI_REPS:-2}" ${CLI_ARGS:-} \
                >> "$OUT/cli_$t.md" 2>> "$OUT/cli_$t.log"
        done
        cat "$OUT/cli_$t.md" ;;
    *) stamp "unknown phase $ph (threads, depth=T[@CPUS], tiles=T[@CPUS], parts=T[@CPUS], prefetch=T[@CPUS], cli=T[@CPUS], ktests)" ;;
    esac
done
stamp "done"
