#!/usr/bin/env bash
# Configures build-fuzz, scripts/fuzz.sh's build: clang,
# AddressSanitizer + UBSan, every object coverage-instrumented for libFuzzer (KEEL_FUZZ), the test
# binaries linked as usual and the harnesses of tests/fuzz linked with libFuzzer. The layers build
# at -Og (CMakeLists.txt's sanitizer branch: near libFuzzer's advised -O1, quicker to compile in
# CI's cold build), the harnesses at the Release -O2 that CMakeLists.txt sets. Sourced.
# OpenMP is clang's libomp; oneDNN (Debian's, built with GCC) calls libgomp's GOMP_* entry points,
# which libomp also provides and which resolve to it (the binaries list libomp first), so one
# OpenMP runtime serves both.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_FUZZ=ON \
  -DKEEL_UNITY_BUILD=ON -DKEEL_BUILD_BENCH=OFF -DKEEL_CUDA=OFF -DKEEL_NCCL=OFF \
  >/dev/null  # nvcc objects take no sanitizers: CUDA is built and tested by the release build
