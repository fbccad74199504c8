#!/usr/bin/env bash
# Build llama.cpp's llama-server (the same-run peer of bench/bench_structured.py), or another of its tools, from the
# llama.cpp sources vendored in the llama-cpp-python sdist on PyPI, at lowest CPU priority with 2 jobs; prints the
# binary's path.
#   usage: bash bench/setup_llama_server.sh [TOOL]   (default llama-server; llama-perplexity for
#          bench/bench_perplexity.py; idempotent: reuses bench/cache/TOOL)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_CPP_PY_VERSION:-0.3.36}"
cache="$here/cache"
tool="${1:-llama-server}"
out="$cache/$tool"
if [[ -x "$out" && -z "${FORCE:-}" ]]; then echo "$out"; exit 0; fi
mkdir -p "$cache/src"
py="${PYTHON:-python}"
command -v cmake >/dev/null || "$py" -m pip install -q cmake ninja
sdist="$(ls "$cache"/src/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)"
if [[ -z "$sdist" ]]; then
    "$py" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$cache/src" "llama-cpp-python==$version"
    sdist="$cache/src/llama_cpp_python-$version.tar.gz"
fi
tar xzf "$sdist" -C "$cache/src"
src="$cache/src/llama_cpp_python-$version/vendor/llama.cpp"
nice -n 19 cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
nice -n 19 cmake --build "$src/build" --target "$tool" -j "${JOBS:-2}" >/dev/null
cp "$src/build/bin/$tool" "$out"
echo "$out"
