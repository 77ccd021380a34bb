#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz in build-fuzz (scripts/fuzz-build.sh: clang, ASan +
# UBSan, coverage-instrumented layers) and runs a campaign per target, from its committed seed
# corpus (tests/fuzz/corpus/<target>) plus what earlier campaigns found (build-fuzz/corpus/<target>),
# two targets at a time. KEEL_FUZZ_SECONDS (default 8; scripts/test.sh runs the default) bounds
# each campaign; a finding fails the script and leaves its input in build-fuzz/fuzz-<target>/
# (crash-*, timeout-*, oom-*), reproducible with build-fuzz/tests/fuzz/fuzz_<target> FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${KEEL_FUZZ_SECONDS:-8}
source scripts/fuzz-build.sh
# The cores (GNU nproc prints OMP_NUM_THREADS when it is set: test.sh's 1 built this on one core).
cmake --build build-fuzz -j "${KEEL_BUILD_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}" \
  --target fuzz_targets
export OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
campaign() {  # campaign TARGET: one libFuzzer run; prints its log's tail when it finds something
  local t=$1 dir=build-fuzz/fuzz-$1
  mkdir -p "$dir" "build-fuzz/corpus/$t"
  if (cd "$dir" && "../tests/fuzz/fuzz_$t" -max_total_time="$secs" -max_len=16384 \
      -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 "../corpus/$t" \
      "../../tests/fuzz/corpus/$t" >log 2>&1); then
    echo "fuzz: $t ${secs}s, $(grep -oE "number_of_executed_units: *[0-9]+" "$dir/log" | grep -oE "[0-9]+") inputs, nothing found"
  else
    tail -n 60 "$dir/log"; echo "fuzz: $t found a failure ($dir/log)"; return 1
  fi
}
export -f campaign; export secs
ls tests/fuzz/corpus | xargs -P 2 -I{} bash -c 'campaign {}'
