#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz with clang (ASan + UBSan, coverage-instrumented
# layers) in build-fuzz and runs a short campaign per target, from its committed seed corpus
# (tests/fuzz/corpus/<target>) plus what earlier campaigns found (build-fuzz/corpus/<target>).
# KEEL_FUZZ_SECONDS (default 10) bounds each campaign; a finding fails the script and leaves its
# input in build-fuzz/ (crash-*, timeout-*, oom-*), reproducible with build-fuzz/tests/fuzz/<target> FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${KEEL_FUZZ_SECONDS:-10}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_FUZZ=ON \
  -DKEEL_CUDA=OFF -DKEEL_NCCL=OFF -DKEEL_BUILD_TESTS=OFF -DKEEL_BUILD_BENCH=OFF \
  -DKEEL_WERROR=OFF >/dev/null  # clang's warnings differ from GCC's; the release build keeps -Werror
cmake --build build-fuzz -j "$(nproc)" --target fuzz_targets
export OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for src in tests/fuzz/fuzz_*.cpp; do
  t=$(basename "$src" .cpp)
  mkdir -p "build-fuzz/corpus/$t"
  echo "fuzz: $t for ${secs}s"
  (cd build-fuzz && "./tests/fuzz/$t" -max_total_time="$secs" -max_len=16384 -rss_limit_mb=2048 \
    -timeout=10 -print_final_stats=1 "corpus/$t" "../tests/fuzz/corpus/${t#fuzz_}" 2>"$t.log") ||
    { tail -n 60 "build-fuzz/$t.log"; echo "fuzz: $t found a failure (build-fuzz/$t.log)"; exit 1; }
  grep -E "^stat::number_of_executed_units" "build-fuzz/$t.log" || true
done
