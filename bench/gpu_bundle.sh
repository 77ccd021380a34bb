#!/usr/bin/env bash
# Packs what bench/gpu_check.sh runs (keel, test_cuda, test_dist, bench_gpu, compare_keel) with the
# shared libraries a bare GPU machine lacks, for a GPU machine that cannot install Debian packages
# (oneDNN, toml++, fmt, Open MPI): build here, carry the archive, and run
# `bash bench/gpu_check.sh --prebuilt ARCHIVE` there. The CUDA libraries stay out (cuBLASLt and
# NCCL are hundreds of MB): the GPU machine's own CUDA 13 provides them, and gpu_check.sh finds
# their directories.
#
#   bash bench/gpu_bundle.sh [BUILD_DIR=build] [ARCHIVE=build-gpu-bundle/keel-gpu.tar.xz]
#
# BUILD_DIR must hold a CUDA build (KEEL_CUDA=ON or AUTO with nvcc) that includes sm_90. The
# binaries keep the paths compiled into them (the tests' source and build directories): the
# archive records them in bundle.env so that gpu_check.sh can link them to where it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
archive=${2:-build-gpu-bundle/keel-gpu.tar.xz}
grep -q "^KEEL_CUDA:STRING=\(ON\|AUTO\)" "$build/CMakeCache.txt" ||
  { echo "gpu_bundle: $build is not a CUDA build (configure with -DKEEL_CUDA=ON)"; exit 1; }
cmake --build "$build" --target keel_cli test_cuda test_dist bench_gpu compare_keel
stage=$(mktemp -d /tmp/keel-gpu-bundle.XXXXXX)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for b in keel tests/test_cuda tests/test_dist bench/bench_gpu bench/compare_keel; do
  strip -o "$stage/bin/$(basename "$b")" "$build/$b"
done
# Every shared library they need, except the C library's own, the driver's and CUDA's big
# ones (taken from the GPU machine).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libcuda\.|libnccl|libcublas)'
for b in "$stage"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] || cp -L "$path" "$stage/lib/$name"
done
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
cat >"$stage/bundle.env" <<EOF
KEEL_BUNDLE_SOURCE_DIR=$src
KEEL_BUNDLE_BUILD_DIR=$(cd "$build" && pwd)
KEEL_BUNDLE_COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo -dirty)
EOF
mkdir -p "$(dirname "$archive")"
tar -C "$stage" -cf - . | xz -6 -T0 >"$archive"
echo "gpu_bundle: $archive ($(du -h "$archive" | cut -f1)): $(ls "$stage/bin" | tr '\n' ' ')+ $(ls "$stage/lib" | wc -l) libraries"
