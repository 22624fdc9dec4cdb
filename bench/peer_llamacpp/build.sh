#!/usr/bin/env bash
# Builds llama-bench from the pruned llama.cpp source (fetch_source.sh) into bench/peer_llamacpp/build/, and copies
# the binary with the shared libraries it loads into bench/peer_llamacpp/bin/ (both git-ignored).
# Usage: bash bench/peer_llamacpp/build.sh [cuda|cpu]      (default cuda: CUDA for sm_90 and the CPU backend)
#   JOBS      parallel compile jobs (default: every core)
#   CUDA_ARCH CMAKE_CUDA_ARCHITECTURES (default 90; the H200 is sm_90)
#   BUILD_DIR build folder (default bench/peer_llamacpp/build/<cpu|cuda>): kept between calls while the GPU
#             machine stays warm; a second run only relinks what changed
# Prints the configure and build times and the size of what bin/ holds.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIND=${1:-cuda}
SRC=$HERE/llama.cpp
BUILD=${BUILD_DIR:-$HERE/build/$KIND}
BIN=$HERE/bin/$KIND
JOBS=${JOBS:-$(nproc)}
[ -f "$SRC/CMakeLists.txt" ] || { echo "build.sh: no source in $SRC: run bench/peer_llamacpp/fetch_source.sh first" >&2; exit 1; }
cat "$SRC/PEER_SOURCE.txt"

# Flags: Release, only llama-bench (no tests, examples, server, tools but it, app, UI, HTTPS, subprocess, NCCL),
# shared libraries (libggml-cuda.so apart from the binary: the CUDA kernels are one file to return or carry),
# the CPU backend for this machine's ISA (AVX-512 / AMX where the CPU has them: experts computed on the CPU
# are part of the comparison), flash attention kernels for f16 K/V only (GGML_CUDA_FA_ALL_QUANTS off, the default).
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_COMMON=ON
  -DLLAMA_OPENSSL=OFF -DLLAMA_SUBPROCESS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_IS_DEV=OFF
  -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON)
case $KIND in
  cuda)
    export PATH=/usr/local/cuda/bin:$PATH
    extra=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA_ALL_QUANTS=OFF
           -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_GRAPHS=ON -DCMAKE_CUDA_COMPILER="${CUDACXX:-$(command -v nvcc)}") ;;
  cpu)  extra=(-DGGML_CUDA=OFF) ;;
  *) echo "build.sh: cuda or cpu, not $KIND" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$BUILD")"
t0=$(date +%s)
cmake -S "$SRC" -B "$BUILD" "${common[@]}" "${extra[@]}" > "$BUILD.configure.log" 2>&1 \
  || { tail -n 40 "$BUILD.configure.log"; exit 1; }
t1=$(date +%s)
cmake --build "$BUILD" --target llama-bench -j "$JOBS"
t2=$(date +%s)
rm -rf "$BIN"; mkdir -p "$BIN"
cp -a "$BUILD"/bin/llama-bench "$BIN"/
# every shared library of the build that the binary loads (libllama, libggml*, libllama-common ...), links kept
for f in "$BUILD"/bin/*.so*; do [ -e "$f" ] && cp -a "$f" "$BIN"/; done
echo "build.sh: $KIND configure $((t1 - t0)) s, build $((t2 - t1)) s with $JOBS jobs"
ls -la "$BIN"; du -sh "$BIN"
"$BIN"/llama-bench --help 2>&1 | grep -E -- "n-cpu-moe|override-tensor|moe-cache|n-depth" || true
