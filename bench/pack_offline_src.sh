#!/usr/bin/env bash
# Packs the sources bench/sweep_offline.sh builds from, on a machine with a package registry, for one without:
#   bash bench/pack_offline_src.sh OUT_DIR IK_GIT_DIR [LLAMA_CPP_PYTHON_VERSION]
# OUT_DIR/llama_cpp_python-VER.tar.gz  the build inputs of the llama-cpp-python sdist's vendor/llama.cpp (CMake
#                                      files, ggml, src, common, tools minus its web UI: ~7.5 MB of the sdist's 77)
# OUT_DIR/ik_src.tar.gz, ik_commit     ik_llama.cpp's build inputs at IK_GIT_DIR's HEAD (a clone, bare or not),
#                                      without examples/server (its web assets are the bulk, and a mirror may lack
#                                      them), whose add_subdirectory line is commented out
# OUT_DIR/whl/gguf-*.whl               the one pure-Python package the models need that such machines lacked
# OUT_DIR/whl/*.whl                    bitnet serve's packages the device image lacks (FastAPI, uvicorn, pydantic,
#                                      llguidance, ...), for its CPython (PYVER, default 3.12)
# The whole is ~18 MB: it travels with the working tree to a leased machine (`carry`).
set -euo pipefail
out="${1:?OUT_DIR}"; ik="${2:?IK_GIT_DIR}"; ver="${3:-0.3.36}"
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out/whl"; out="$(cd "$out" && pwd)"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT

sdist="$root/bench/cache/src/llama_cpp_python-$ver.tar.gz"       # bench/setup_llama.sh keeps it there
if [[ ! -f "$sdist" ]]; then
    python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$tmp"
    sdist="$tmp/llama_cpp_python-$ver.tar.gz"
fi
top="llama_cpp_python-$ver"; v="$top/vendor/llama.cpp"
tar xzf "$sdist" -C "$tmp" "$v"
(cd "$tmp" && tar czf "$out/$top.tar.gz" --exclude="$v/tools/ui" --exclude="$v/tools/server/public*" \
    "$v/CMakeLists.txt" "$v/LICENSE" "$v/cmake" "$v/common" "$v/ggml" "$v/include" "$v/src" "$v/tools" \
    "$v/vendor" "$v/licenses" "$v/app")

examples=$(git -C "$ik" ls-tree --name-only HEAD examples/ | grep -v '^examples/server$')
mkdir "$tmp/ik"
# a mirror without the server's web assets makes git print "invalid object" for them: the archive is still whole
# shellcheck disable=SC2086
git -C "$ik" archive HEAD CMakeLists.txt LICENSE cmake common ggml include src vendor pocs llama-mmap.h \
    spm-headers $examples | tar -x -C "$tmp/ik"
sed -i 's/^\(\s*\)add_subdirectory(server)/\1# add_subdirectory(server)/' "$tmp/ik/examples/CMakeLists.txt"
(cd "$tmp/ik" && tar czf "$out/ik_src.tar.gz" .)
git -C "$ik" rev-parse --short=12 HEAD > "$out/ik_commit"

python -m pip download -q --no-deps --only-binary=:all: -d "$out/whl" \
    "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))' 2>/dev/null || echo 0.19.0)"
# bitnet serve's and the CLI's packages that the device image (CPython $PYVER, KINDS.md's list) lacks, at the
# versions installed here, for its Python: bench_tiles.py --e2e starts `bitnet serve` there
PYVER="${PYVER:-3.12}"
plats=(); for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
pins=$(python - <<'PY'
import importlib.metadata as m
names = ["fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
         "llguidance", "prompt_toolkit", "wcwidth", "argcomplete", "opentelemetry-api", "typing_extensions",
         "annotated-doc"]
out = []
for n in names:
    try:
        out.append(f"{n}=={m.version(n)}")
    except m.PackageNotFoundError:
        out.append(n)
print(" ".join(out))
PY
)
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${plats[@]}" --platform manylinux2014_x86_64 -d "$out/whl" $pins
du -sh "$out"/* | sed 's/^/packed /'
