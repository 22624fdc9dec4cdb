#!/usr/bin/env bash
# Builds llama-bench from the pruned llama.cpp source (fetch_source.sh) into bench/peer_llamacpp/build/, and copies
# the binary with the shared libraries it loads into bench/peer_llamacpp/bin/ (both git-ignored).
# Usage: bash bench/peer_llamacpp/build.sh [cuda|cpu]      (default cuda: CUDA for sm_90 and the CPU backend)
#   JOBS      parallel compile jobs (default: every core)
#   CUDA_ARCH CMAKE_CUDA_ARCHITECTURES (default 90; the H200 is sm_90)
#   BUILD_DIR build folder (default bench/peer_llamacpp/build/<cpu|cuda>): kept between calls while the GPU
#             machine stays warm; a second run only relinks what changed
#   CUDA_ROOT a CUDA toolkit other than /usr/local/cuda: a folder with bin/nvcc, include/, lib/ (e.g. the pip wheels
#             nvidia-cuda-nvcc, -runtime, -crt, -cccl, -nvvm and nvidia-cublas 13.0.x installed with --target, their
#             nvidia/cu13 folder). A machine without a GPU driver links against a stub libcuda.so (made here, in
#             the build folder): the binary then finds the driver's libcuda.so.1 where it runs
#             CUDA_ROOT=wheels: those wheels (13.0, ~0.5 GB) installed with pip into bench/peer_llamacpp/cuda13/ first
#   CPU_ISA   native (default: the CPU backend for this machine's ISA) or spr (AVX-512 F/CD/VL/DQ/BW/VBMI/VNNI/BF16
#             and AMX tile/int8/bf16, named: a build away from the GPU machine for its Sapphire Rapids CPU)
#   PACK      a folder: bin/<kind> packed there as peer_bin_<kind>.tar.xz.part-NN (xz, 15 MB parts: what a device
#             call carries as bench/peer_llamacpp/dist/ and the peer suite unpacks)
# Away from the GPU machine (2 cores: ~28 min): CUDA_ROOT=wheels CPU_ISA=spr PACK=bench/peer_llamacpp/dist \
#   bash bench/peer_llamacpp/build.sh cuda
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
  -DGGML_OPENMP=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON)
case ${CPU_ISA:-native} in
  native) common+=(-DGGML_NATIVE=ON) ;;
  spr) common+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON) ;;
  *) echo "build.sh: CPU_ISA native or spr, not $CPU_ISA" >&2; exit 2 ;;
esac
case $KIND in
  cuda)
    if [ "${CUDA_ROOT:-}" = wheels ]; then
      CUDA_ROOT=$HERE/cuda13/nvidia/cu13
      [ -x "$CUDA_ROOT/bin/nvcc" ] || python3 -m pip install -q --no-deps --only-binary=:all: --target "$HERE/cuda13" \
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14
    fi
    root=${CUDA_ROOT:-/usr/local/cuda}
    export PATH=$root/bin:$PATH
    extra=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA_ALL_QUANTS=OFF
           -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_GRAPHS=ON -DCMAKE_CUDA_COMPILER="${CUDACXX:-$(command -v nvcc)}")
    if [ -n "${CUDA_ROOT:-}" ]; then
      # the wheels' lib/ holds only versioned libraries: add the names the linker asks for, lib64/, and a stub of the
      # driver's libcuda.so (lib/stubs/, where FindCUDAToolkit looks) for a machine without a GPU driver
      [ -e "$root/lib64" ] || ln -s lib "$root/lib64"
      for l in cudart cublas cublasLt; do [ -e "$root/lib/lib$l.so" ] || ln -s "lib$l.so.13" "$root/lib/lib$l.so"; done
      if [ ! -e "$root/lib/stubs/libcuda.so" ]; then
        mkdir -p "$root/lib/stubs"
        echo 'void ft_libcuda_stub(void) {}' > "$root/lib/stubs/stub.c"
        cc -shared -fPIC -o "$root/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$root/lib/stubs/stub.c"
      fi
      # --no-as-needed: the stub defines none of the driver's functions, so a linker that drops unused libraries
      # would leave libcuda.so.1 out of libggml-cuda.so's needed list, and the binary would stop at its first
      # driver call ("undefined symbol: cuDeviceGet") where it runs
      extra+=(-DCUDAToolkit_ROOT="$root" -DCMAKE_EXE_LINKER_FLAGS="-Wl,--allow-shlib-undefined -L$root/lib/stubs"
              -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--no-as-needed")
    fi ;;
  cpu)  extra=(-DGGML_CUDA=OFF) ;;
  *) echo "build.sh: cuda or cpu, not $KIND" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$BUILD")"
# llama.cpp's build-info asks git for its commit from the source folder, and would find this project's repository
# around it (llama-bench then reported this tree's commit as its build); the source distribution has no git
# metadata of its own, so its build stays "unknown" and docs/PEERS.md names the release (b11434)
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES=$(dirname "$(cd "$SRC" && pwd)")
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
if [ "$KIND" = cuda ] && command -v readelf >/dev/null; then
  readelf -d "$BIN"/libggml-cuda.so | grep -q 'NEEDED.*libcuda\.so' \
    || { echo "build.sh: libggml-cuda.so does not name libcuda.so.1 among its needed libraries" >&2; exit 1; }
fi
if [ -n "${PACK:-}" ]; then
  mkdir -p "$PACK" && rm -f "$PACK"/peer_bin_"$KIND".tar.xz.part-*
  tar -C "$HERE/bin" -cf - "$KIND" | xz -T0 -6 | split -b 15m -d - "$PACK/peer_bin_$KIND.tar.xz.part-"
  ls -la "$PACK"/peer_bin_"$KIND".tar.xz.part-*
fi
