#!/usr/bin/env bash
# The Python packages the GPU machine lacks, as wheels for its Python 3.12 (it reaches no package index), into .whl/
# (git-ignored); bench/run_gpu.sh installs every .whl/*.whl it is given. Run here, where pip reaches PyPI; carry
# .whl in each device call. The device tool's README (../.library/device) says how wheels travel.
# Usage: bash bench/gpu_wheels.sh [all|peer]     (default all)
#   all   what the GPU suites import: pyzmq, msgpack, psutil, llguidance, fla-core and einops (Qwen3-Next's linear
#         attention), jsonschema (structured-output tests), pytest with pytest-xdist (run_gpu.sh tests), gguf
#   peer  the `peer` suite's share (with the packed llama-bench, the call's tree stays under its 64 MiB): pyzmq,
#         msgpack, psutil, gguf, fla-core, einops
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-all}
peer=(pyzmq==27.3.0 msgpack==1.2.4 psutil==7.2.2 gguf==0.19.0 fla-core==0.6.0 einops==0.8.2)
rest=(jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
      pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 pluggy==1.7.0 iniconfig==2.3.1)
case $KIND in
  all) pkgs=("${peer[@]}" "${rest[@]}"); extra=("llguidance==1.9.1") ;;
  peer) pkgs=("${peer[@]}"); extra=() ;;
  *) echo "gpu_wheels.sh: all or peer, not $KIND" >&2; exit 2 ;;
esac
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "$@" -d .whl; }
dl "${plat[@]}" "${pkgs[@]}"
if [ ${#extra[@]} -gt 0 ]; then dl --platform manylinux_2_31_x86_64 "${plat[@]}" "${extra[@]}"; fi   # llguidance: 2_31
ls .whl
du -sh .whl
