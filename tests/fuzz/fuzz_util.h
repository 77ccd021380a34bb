// Shared by the libFuzzer harnesses (scripts/fuzz.sh): each writes the input where keel's reader
// expects a file and runs the reader. A keel::Error is the expected answer to bad input; anything
// else escaping (a raw JSON exception, std::bad_alloc) and every sanitizer report is a finding.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "keel/numerics/error.h"

namespace keel::fuzz {

// A directory of this process for the harness's files.
inline const std::string& work_dir() {
  static const std::string d = [] {
    const auto p =
        std::filesystem::temp_directory_path() / ("keel-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return d;
}

inline std::string write(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = work_dir() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

inline std::string write(const std::string& name, const std::string& text) {
  return write(name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Runs `f`, accepting a keel::Error.
template <class F>
void expect_keel_errors_only(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace keel::fuzz
