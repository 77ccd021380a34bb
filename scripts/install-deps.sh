#!/usr/bin/env bash
# Installs what keel needs from Debian 12 packages (run as root). Idempotent: skips when present.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config git
      libdnnl-dev libomp-dev nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libfmt-dev
      libgtest-dev libbenchmark-dev openmpi-bin libopenmpi-dev
      libpcre2-dev
      # keel serve: HTTP (cpp-httplib), the run registry (SQLite), the dashboard's browser test
      libcpp-httplib-dev libsqlite3-dev chromium chromium-driver
      # clang with libFuzzer (libclang-rt-14-dev) for the fuzz harnesses of scripts/fuzz.sh
      clang libclang-rt-14-dev
      # libdnnl-dev's CMake config (dnnl-config.cmake) calls find_package(OpenCL REQUIRED), but
      # Debian only recommends the package that provides it, and recommends are not installed here.
      ocl-icd-opencl-dev)
if [ "${KEEL_WITH_TORCH:-0}" = 1 ]; then pkgs+=(python3-torch python3-numpy libopenblas0-openmp python3-jinja2); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node and npm run the tokenizer parity test (tests/data/test_bpe_parity.cpp). Checked as commands:
# a machine may have them from another source (NodeSource's nodejs bundles npm and conflicts with
# Debian's npm package).
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then missing+=(nodejs npm); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
