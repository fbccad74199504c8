#!/usr/bin/env bash
# The whole thread sweep on a machine with no package registry (a 16-core box reached with carried
# sources): builds ours in place, llama.cpp's llama-bench from the llama-cpp-python sdist's vendored
# sources and ik_llama.cpp's llama-bench + llama-quantize from a source tarball, all in parallel; generates
# the synthetic 2B-4T models (TQ2_0, our store, IQ2_BN for ik); runs bench/bench_threads.py over all three.
#   usage: SRC=dir-with-carried-files OUT=results-dir [THREADS=1,2,4,8,12,16] bash bench/sweep_offline.sh
# SRC holds: whl/*.whl (pure-Python deps absent there: gguf, diskcache, ...), llama_cpp_python-*.tar.gz,
# ik_src.tar.gz (a git archive of ik_llama.cpp: CMakeLists.txt cmake common ggml include src examples vendor,
# without examples/server, whose add_subdirectory line is commented out), ik_commit (its commit, for the table).
# Every step writes its log under $OUT; the sweep writes THREADS_RESULTS.md / threads_results.{json,png} there.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$(cd "${SRC:?carried sources}" && pwd)"; OUT="${OUT:?results dir}"; THREADS="${THREADS:-1,2,4,8,12,16}"
JOBS="${JOBS:-$(nproc)}"
py="${PYTHON:-python3}"
site=/tmp/sweep-site; work=/tmp/sweep-build
mkdir -p "$site" "$work" "$OUT"
$py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$SRC"/whl/*.whl || exit 1
# the checkout is the package bitnet_cpu (pyproject maps it to the root): import it through a link, no install
mkdir -p /tmp/sweep-pkg && ln -sfn "$root" /tmp/sweep-pkg/bitnet_cpu
export PYTHONPATH="/tmp/sweep-pkg:$site${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

( cd "$work" && rm -rf ik && mkdir ik && tar xzf "$SRC/ik_src.tar.gz" -C ik && cd ik &&
  cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release &&
  cmake --build build -j "$JOBS" --target llama-bench llama-quantize ) > "$OUT/ik_build.log" 2>&1 &
ik_pid=$!
# llama.cpp: its own llama-bench, built from the llama-cpp-python sdist's vendored sources (the Python binding
# built on such a machine crashed in llama_model_load; llama-bench times the same library code)
( cd "$work" && rm -rf llama && mkdir llama && tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C llama &&
  cmake -S llama/*/vendor/llama.cpp -B llama/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DCMAKE_BUILD_TYPE=Release &&
  cmake --build llama/build -j "$JOBS" --target llama-bench ) > "$OUT/llama_build.log" 2>&1 &
llama_pid=$!

cd "$root"
stamp "building ours"
$py setup.py build_ext --inplace -j "$JOBS" > "$OUT/ours_build.log" 2>&1 || { tail "$OUT/ours_build.log"; exit 1; }
stamp "generating 2B-4T models"
$py bench/make_models.py --no-f16 2>&1 | tail -4
wait $ik_pid || { stamp "ik build failed"; tail -5 "$OUT/ik_build.log"; }
ikb="$work/ik/build/bin"
if [[ -x "$ikb/llama-quantize" ]]; then
    stamp "IQ2_BN for ik_llama.cpp"
    $py bench/make_models.py --no-f16 --ik-quantize "$ikb/llama-quantize" 2>&1 | tail -2
fi
wait $llama_pid || { stamp "llama.cpp build failed"; tail -5 "$OUT/llama_build.log"; }
stamp "sweep"
sdist="$(basename "$SRC"/llama_cpp_python-*.tar.gz .tar.gz)"
LLAMA_VERSION="llama.cpp vendored in llama-cpp-python ${sdist#llama_cpp_python-}, its llama-bench" \
    IK_LLAMA_VERSION="ik_llama.cpp $(cat "$SRC/ik_commit" 2>/dev/null || echo '?')" PYTHONUNBUFFERED=1 \
    $py bench/bench_threads.py --threads "$THREADS" --engines ours,llama,ik --ik-bench "$ikb/llama-bench" \
    --llama-bench "$work/llama/build/bin/llama-bench" --no-busy --out "$OUT" "$@"
stamp "done"
