#!/usr/bin/env bash
# Build llama-cpp-python (which compiles llama.cpp) once, cache the wheel under bench/cache/wheels,
# and install it into the current Python environment.  Optional: only bench/bench_e2e.py uses it;
# the test suite never does.  The build runs at lowest CPU priority with 2 compile jobs so that it
# does not starve other work on a small machine.
#   usage: bash bench/setup_llama.sh            (idempotent: reuses the cached wheel)
#          LLAMA_CPP_PY_VERSION=0.3.36 FORCE=1 bash bench/setup_llama.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_CPP_PY_VERSION:-0.3.36}"
wheels="$here/cache/wheels"
mkdir -p "$wheels"
py="${PYTHON:-python}"

if [[ -z "${FORCE:-}" ]] && "$py" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$version' else 1)" 2>/dev/null; then
    echo "llama-cpp-python $version already installed"
    exit 0
fi

wheel="$(ls "$wheels"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" || -n "${FORCE:-}" ]]; then
    echo "building llama-cpp-python $version (compiles llama.cpp; takes a while) ..."
    # Native CPU flags (AVX-512 etc.) so llama.cpp runs its best kernels on this machine; no network
    # features, no GPU, no examples/tests/server.
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
    nice -n 19 "$py" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$version"
    wheel="$(ls "$wheels"/llama_cpp_python-"$version"-*.whl | head -n1)"
fi
# Runtime deps of the binding are small pure-Python packages (diskcache, jinja2, typing-extensions).
"$py" -m pip install --force-reinstall --no-deps "$wheel"
"$py" -m pip install "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0" >/dev/null
"$py" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed from', '$wheel')"
