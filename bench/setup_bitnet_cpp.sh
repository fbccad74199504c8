#!/usr/bin/env bash
# Build bitnet.cpp's llama-bench (Microsoft's engine, I2_S kernels) for bench/decode_rows.py --bitnet-bench.
# Optional, never used by the tests.
#
# Which bitnet.cpp: microsoft/BitNet 4645960 (2024-11-08), the newest release whose llama.cpp submodule
# (Eddie-Wang1120/llama.cpp 406a5036) could be had here; its later submodules (2025-2026, the releases with the
# 2B-4T graph and the 2025-11 parallel I2_S kernels) could not. So this is the bitnet.cpp of the first
# releases: I2_S through ggml-bitnet-mad.cpp under the `bitnet` architecture; say so next to any ratio to it.
#
#   usage: bash bench/setup_bitnet_cpp.sh                  clones both at those commits (needs github.com)
#          BITNET_SRC=DIR LLAMA_SRC=DIR bash bench/setup_bitnet_cpp.sh
#                                                          source trees already here (the same commits)
#   prints the path of llama-bench (default build dir: bench/cache/bitnet.cpp; BUILD_DIR=... to change)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="${BUILD_DIR:-$here/cache/bitnet.cpp}"
bitnet_commit=4645960
llama_commit=406a5036f9a8aaee9ec5e96e652f61691340fe95
bench="$dest/build/bin/llama-bench"
if [[ -x "$bench" && -z "${FORCE:-}" ]]; then
    echo "$bench"
    exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
if [[ -n "${BITNET_SRC:-}" ]]; then
    [[ -n "${LLAMA_SRC:-}" ]] || { echo "setup_bitnet_cpp: BITNET_SRC needs LLAMA_SRC too (its llama.cpp fork)" >&2; exit 2; }
    cp -r "$BITNET_SRC"/. "$dest"/
    rm -rf "$dest/3rdparty/llama.cpp"
    mkdir -p "$dest/3rdparty"
    cp -r "$LLAMA_SRC" "$dest/3rdparty/llama.cpp"
else
    git clone -q https://github.com/microsoft/BitNet "$dest"
    git -C "$dest" checkout -q "$bitnet_commit"
    git clone -q https://github.com/Eddie-Wang1120/llama.cpp "$dest/3rdparty/llama.cpp.tmp"
    git -C "$dest/3rdparty/llama.cpp.tmp" checkout -q "$llama_commit"
    rm -rf "$dest/3rdparty/llama.cpp"
    mv "$dest/3rdparty/llama.cpp.tmp" "$dest/3rdparty/llama.cpp"
fi
# ggml's CMakeLists names the generated TL kernel header even for an I2_S-only build: its shipped preset
# (TL2 stays off, so none of it is compiled in)
cp "$dest/preset_kernels/bitnet_b1_58-3B/bitnet-lut-kernels-tl2.h" "$dest/include/bitnet-lut-kernels.h"
cp "$dest/preset_kernels/bitnet_b1_58-3B/kernel_config_tl2.ini" "$dest/include/kernel_config.ini"
echo "building bitnet.cpp's llama-bench in $dest (a few minutes) ..." >&2
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF >/dev/null
nice -n 19 cmake --build "$dest/build" --target llama-bench -j "${JOBS:-2}" >/dev/null
echo "$bench"
