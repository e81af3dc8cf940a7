#!/usr/bin/env bash
# Compile-check every CUDA source shipped with readerlib, so a syntax error cannot land.
#
#   bash tools/check_cuda.sh            # from anywhere; CI calls it
#
# For each readerlib/kernels/cuda/*.cu: nvcc -arch=$CUDA_ARCH (default sm_90) -c with
# warnings as errors, then --ptx with -ftz=true (what CuPy's RawModule passes) and
# a check that no .ftz instruction was emitted (see cuda/common.cuh for why).
# Without nvcc on PATH it prints a note and exits 0, or 1 when CHECK_CUDA_REQUIRED=1.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
arch=${CUDA_ARCH:-sm_90}

if ! command -v nvcc >/dev/null 2>&1; then
    echo "check_cuda: nvcc not on PATH; CUDA sources NOT compile-checked"
    [[ "${CHECK_CUDA_REQUIRED:-0}" == "1" ]] && exit 1
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "check_cuda: $(nvcc --version | tail -1), -arch=$arch"

status=0
shopt -s nullglob
sources=("$root"/readerlib/kernels/cuda/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
    echo "check_cuda: no .cu files under readerlib/kernels/cuda"
    exit 1
fi
for src in "${sources[@]}"; do
    name=$(basename "$src" .cu)
    rel=${src#"$root"/}
    if ! nvcc -arch="$arch" -std=c++17 -Werror all-warnings -c "$src" -o "$tmp/$name.o"; then
        echo "FAIL $rel: nvcc -c"
        status=1
        continue
    fi
    if ! nvcc -arch="$arch" -std=c++17 -ftz=true --ptx "$src" -o "$tmp/$name.ptx"; then
        echo "FAIL $rel: nvcc --ptx"
        status=1
        continue
    fi
    if grep -n '\.ftz' "$tmp/$name.ptx" | head -5; then
        echo "FAIL $rel: flush-to-zero instructions in the PTX (use the helpers in common.cuh)"
        status=1
        continue
    fi
    echo "ok   $rel ($(grep -c '\.entry' "$tmp/$name.ptx") kernels)"
done
exit $status
