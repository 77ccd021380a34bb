#!/usr/bin/env bash
# Installs what is missing, builds keel twice (release; AddressSanitizer + UBSan) and runs the
# whole test suite in both. Used by the README's Quick start and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase prints its wall time, so a CI log shows where the minutes go.
phase_start=$SECONDS
phase_done() { echo "test.sh: $1 took $((SECONDS - phase_start)) s (total $SECONDS s)"; phase_start=$SECONDS; }
bash scripts/install-deps.sh
phase_done "installing dependencies"
# The cores, whatever OMP_NUM_THREADS says: GNU nproc prints OMP_NUM_THREADS when it is set, and
# the fuzz build once ran on one core under the export below.
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export KEEL_BUILD_JOBS=$jobs
# ctest runs test binaries in parallel, one per core: each runs its OpenMP code on one thread so
# they never oversubscribe the machine. Tests that check thread-count independence set their own
# thread counts (1, 2, 3) explicitly.
export OMP_NUM_THREADS=1

# CUDA (when nvcc is present) is compiled for sm_90 only here, to keep CI short; a plain build
# targets sm_80 and sm_90.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKEEL_UNITY_BUILD=ON >/dev/null  # files compiled in batches: see CMakeLists.txt
cmake --build build -j "$jobs"
phase_done "the release build"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
phase_done "the release tests"

# Sanitizers: the same tests, with ASan + UBSan (leak checks off: OpenMP's and oneDNN's
# thread-local caches live until exit and are reported as leaks). A report keeps 10 frames of the
# stack that allocated and freed a block, not ASan's 30: unwinding and storing 30 at every malloc
# and free took a sixth of a sanitized test's time (CliMoe's first: 16.4 s, 13.8 s with 10), and
# 10 still reach from the kernel to the op that asked.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_SANITIZE=ON -DKEEL_UNITY_BUILD=ON \
  -DKEEL_BUILD_BENCH=OFF -DKEEL_CUDA=OFF >/dev/null  # nvcc objects take no sanitizers: CUDA is built above
cmake --build build-asan -j "$jobs"
phase_done "the sanitized build"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:malloc_context_size=10 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  KEEL_TEST_SANITIZED=1 ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 1800
phase_done "the sanitized tests"

# Fuzzing: a short libFuzzer campaign per input format (safetensors, config.json, tokenizers,
# chat templates, JSONL, TOML, NaN captures, trainer.json), clang + ASan + UBSan,
# KEEL_FUZZ_SECONDS each (6 here; 0 skips it). A finding fails the script. Its clang build (only
# the layers up to train/) takes ~1.5 minutes on 2 cores from cold, the campaigns ~40 s.
export KEEL_FUZZ_SECONDS=${KEEL_FUZZ_SECONDS:-6}
if [ "$KEEL_FUZZ_SECONDS" != 0 ]; then bash scripts/fuzz.sh; phase_done "fuzzing"; fi
